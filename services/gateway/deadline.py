"""A request's whole-life deadline (``gateway.request_timeout_s``).

``until_deadline(stream, deadline_s)`` yields ``stream``'s items until the monotonic
clock passes ``deadline_s``, then closes it (aborting the request on every worker it
reached) and raises ``RequestTimeout``: a 504 before the first byte, an error event
after it. No client waits on a silent worker past the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

from services.gateway.errors import RequestTimeout

__all__ = ["until_deadline"]

T = TypeVar("T")


async def until_deadline(
    stream: AsyncGenerator[T, None], deadline_s: float, timeout_s: float
) -> AsyncGenerator[T, None]:
    async with contextlib.aclosing(stream):
        while True:
            remaining_s = deadline_s - time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, remaining_s)):
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestTimeout(
                    f"the request did not finish within {timeout_s:g} s "
                    "(gateway.request_timeout_s)",
                    None,
                    "timeout",
                ) from None
            yield item
