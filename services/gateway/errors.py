"""Errors the gateway answers with, in OpenAI's nested shape.

    APIError                       {"error": {"message", "type", "param", "code"}}
     ├── BadRequest           400  invalid parameter, prompt over the context length
     ├── Unauthorized         401  missing or wrong API key
     ├── ModelNotFound        404  unknown model
     ├── BodyTimeout          408  body not in within gateway.body_timeout_s of its headers
     ├── PayloadTooLarge      413  body over gateway.max_body_bytes
     ├── Overloaded           429  router rejected, too many requests in flight (Retry-After)
     │    └── RateLimited     429  a key over its limits (Retry-After, x-ratelimit-*)
     ├── NotReady             503  starting or draining, too many connections (Retry-After)
     ├── ServiceFailure       500  no worker could finish the request
     └── RequestTimeout       504  not finished within gateway.request_timeout_s

After a stream has begun, the same body goes out as an SSE ``data:`` event.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "APIError",
    "BadRequest",
    "BodyTimeout",
    "ModelNotFound",
    "NotReady",
    "Overloaded",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "ServiceFailure",
    "Unauthorized",
]


class APIError(Exception):
    status_code = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status_code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(APIError):
    status_code = 400
    error_type = "BadRequestError"


class BodyTimeout(APIError):
    status_code = 408
    error_type = "RequestTimeoutError"


class Unauthorized(APIError):
    status_code = 401
    error_type = "AuthenticationError"


class ModelNotFound(APIError):
    status_code = 404
    error_type = "NotFoundError"


class PayloadTooLarge(APIError):
    status_code = 413
    error_type = "PayloadTooLargeError"


class _RetryLater(APIError):
    """``should_retry=False`` (the same request can never succeed, e.g. a TTFT target
    below what an idle worker needs) adds ``x-should-retry: false``, which OpenAI
    clients honour instead of retrying on their own."""

    def __init__(self, message: str, retry_after_s: float, *, should_retry: bool = True) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry

    def headers(self) -> dict[str, str]:
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        if not self.should_retry:
            headers["x-should-retry"] = "false"
        return headers


class Overloaded(_RetryLater):
    status_code = 429
    error_type = "RateLimitError"


class RateLimited(Overloaded):
    """A key over one of its limits; ``limit_headers`` are OpenAI's ``x-ratelimit-*``."""

    def __init__(self, message: str, retry_after_s: float, limit_headers: dict[str, str]) -> None:
        super().__init__(message, retry_after_s)
        self.code = "rate_limit_exceeded"
        self.limit_headers = limit_headers

    def headers(self) -> dict[str, str]:
        retry_after_ms = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return {**super().headers(), "retry-after-ms": retry_after_ms, **self.limit_headers}


class NotReady(_RetryLater):
    status_code = 503
    error_type = "ServiceUnavailableError"


class ServiceFailure(APIError):
    status_code = 500
    error_type = "InternalServerError"


class RequestTimeout(APIError):
    status_code = 504
    error_type = "TimeoutError"
