"""What a request asks of the output, beyond sampling: constraints, logit_bias, and the rest.

    check_fields(body)          400 for a field that would change the output and that we
                                do not implement; a warning naming the other unknown ones
    structured_output(body)     ``response_format`` / ``structured_outputs`` as the engine's
                                backend-neutral ``StructuredOutput`` (None: unconstrained)
    logit_bias(body)            ``{"<token id>": bias}`` as ``((id, bias), ...)``

Nothing is dropped silently: a client that asks for audio, predicted outputs or web
search learns at once that it will not get them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from services.engine.messages import StructuredOutput
from services.gateway.errors import BadRequest
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["check_fields", "logit_bias", "structured_output"]

log = logging.getLogger(__name__)

# Fields that change what the model must produce; refused unless their value asks for nothing.
_UNIMPLEMENTED = (
    "audio",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "best_of",
    "use_beam_search",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    # vLLM's sampling extensions not implemented here (repetition_penalty is).
    "allowed_token_ids",
    "bad_words",
    "length_penalty",
    "truncate_prompt_tokens",
    "prompt_logprobs",
)
# Said with the refusal: how to get the same otherwise.
_INSTEAD = {"prompt_logprobs": "; a completion's echo with logprobs scores the prompt's tokens"}


def _asks_for_nothing(name: str, value: Any) -> bool:
    if name in ("best_of", "length_penalty"):
        return value in (None, 1)
    return value in (None, False, [], {})


def check_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
    extra = body.model_extra or {}
    for name in _UNIMPLEMENTED:
        if name in extra and not _asks_for_nothing(name, extra[name]):
            raise BadRequest(
                f"{name} is not supported by this server{_INSTEAD.get(name, '')}", name
            )
    if isinstance(body, CompletionRequest) and extra.get("tools"):
        raise BadRequest("tools need the chat completions endpoint", "tools")
    if isinstance(body, CompletionRequest) and body.suffix:  # inserting text: not done here
        raise BadRequest("suffix is not supported by this server", "suffix")
    if body.stream_options is not None and not body.stream:  # as OpenAI and vLLM
        raise BadRequest("stream_options can only be given with stream: true", "stream_options")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    modalities = extra.get("modalities")
    if modalities not in (None, ["text"]):
        raise BadRequest("only the text modality is supported", "modalities")
    handled = {*_UNIMPLEMENTED, "modalities", "tools", "tool_choice", "parallel_tool_calls"}
    ignored = sorted(set(extra) - handled)
    if ignored:
        log.warning("ignoring unknown request fields: %s", ", ".join(ignored))


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise BadRequest("give response_format or structured_outputs, not both", "response_format")
    if rf is not None and rf.type == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise BadRequest("json_schema.schema is required", "response_format")
        return StructuredOutput("json", json.dumps(rf.json_schema.schema_), param="response_format")
    if so is None:
        return None
    kinds: list[tuple[str, str]] = []
    if so.json_ is not None:
        spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        kinds.append(("json", spec))
    if so.regex is not None:
        kinds.append(("regex", so.regex))
    if so.choice is not None:
        kinds.append(("choice", json.dumps(so.choice)))
    if so.grammar is not None:
        kinds.append(("grammar", so.grammar))
    if so.json_object:
        kinds.append(("json_object", ""))
    if so.structural_tag is not None:
        tag = so.structural_tag
        kinds.append(("structural_tag", tag if isinstance(tag, str) else json.dumps(tag)))
    if len(kinds) != 1:
        raise BadRequest(
            "structured_outputs takes exactly one of json, regex, choice, grammar, "
            f"json_object, structural_tag; got {len(kinds)}",
            "structured_outputs",
        )
    kind, spec = kinds[0]
    # Compact unless the client explicitly allows whitespace (disable_any_whitespace: false).
    any_whitespace = so.disable_any_whitespace is False
    return StructuredOutput(kind, spec, any_whitespace, "structured_outputs")  # type: ignore[arg-type]


def logit_bias(body: ChatCompletionRequest | CompletionRequest) -> tuple[tuple[int, float], ...]:
    out: list[tuple[int, float]] = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            out.append((int(key), float(bias)))
        except ValueError as e:
            raise BadRequest(f"logit_bias keys are token ids, got {key!r}", "logit_bias") from e
    return tuple(out)
