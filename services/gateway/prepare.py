"""From a validated OpenAI request to the work to run: prompts, choices, sampling.

prompts -> token ids (done by the caller), SamplingParams per choice (prompts x n),
context-length checks: every problem is a 400 naming the field; the request's
latency targets (milliseconds on the wire, seconds for the router) and priority.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from router.types import SLO, Priority
from services.engine.messages import (
    ImageInput,
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from services.gateway.errors import BadRequest
from services.gateway.fields import logit_bias, structured_output
from services.gateway.openai_format import Endpoint, Formatter
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.service import GatewayService
from services.gateway.shaping import ShapeSpec
from services.gateway.tools import ToolMode, tool_constraint, tool_mode

__all__ = ["Choice", "Generation", "prepare_chat", "prepare_completion"]


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Generation:
    endpoint: Endpoint
    formatter: Formatter
    choices: tuple[Choice, ...]
    num_prompt_tokens: int  # each prompt once, whatever n
    stream: bool
    continuous_usage: bool
    logprobs: bool
    echo_texts: tuple[str, ...] = ()
    prompt_logprobs: bool = False  # echo with logprobs: the echoed tokens' logprobs too
    # echo with max_tokens 0 (vLLM's): the prompt alone, scored; the engines generate one
    # token (they need one), which is dropped, and none is counted.
    echo_only: bool = False
    shape: ShapeSpec = field(default_factory=ShapeSpec)  # chat: reasoning, tool calls
    slo: SLO = field(default_factory=SLO)  # as asked; the service fills in the defaults
    priority: Priority = Priority.INTERACTIVE
    images: tuple[ImageInput, ...] = ()  # a chat prompt's images, at its placeholders


def _sampling(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    seed_offset: int,
    structured: StructuredOutput | None,
) -> SamplingParams:
    stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=None if body.seed is None else _choice_seed(body.seed, seed_offset),
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured=structured,
        logit_bias=logit_bias(body),
    )
    try:
        params.validate()
    except InvalidRequestError as e:
        raise BadRequest(str(e), e.param) from e
    return params


def _choice_seed(seed: int, offset: int) -> int:
    """Choice ``offset``'s seed: the request's plus the offset, wrapped to 64 bits (a
    seed the client may send, 2^63 - 1, gives its second choice -2^63, not a refusal)."""
    return (seed + offset + 2**63) % 2**64 - 2**63


def _check_length(
    svc: GatewayService,
    prompt: tuple[int, ...],
    max_tokens: int | None,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
) -> int:
    """The request's max_tokens, after checking the prompt fits the context
    (``max_tokens_param``: the field the client set it with)."""
    if not prompt:
        raise BadRequest("the prompt is empty", prompt_param)
    max_len = svc.max_model_len()
    if max_len is None:
        return max_tokens or 16
    if len(prompt) >= max_len:
        raise BadRequest(
            f"This model's maximum context length is {max_len} tokens, but the prompt has "
            f"{len(prompt)} tokens.",
            prompt_param,
        )
    if max_tokens is None:
        return max_len - len(prompt)
    if len(prompt) + max_tokens > max_len:
        raise BadRequest(
            f"This model's maximum context length is {max_len} tokens. You requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} "
            f"for the completion). Reduce the prompt or {max_tokens_param}.",
            max_tokens_param,
        )
    return max_tokens


def _generation(
    svc: GatewayService,
    endpoint: Endpoint,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: Sequence[tuple[int, ...]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    tools: ToolMode | None = None,
    shape: ShapeSpec | None = None,
) -> Generation:
    prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    choices: list[Choice] = []
    structured = structured_output(body)
    if tools is not None and tools.forced:
        if structured is not None:
            raise BadRequest(
                "a forced tool call cannot also follow a response format", "tool_choice"
            )
        structured = tool_constraint(tools)
    max_tokens_param = (
        "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    )
    for p_index, prompt in enumerate(prompts):
        budget = _check_length(svc, prompt, max_tokens, prompt_param, max_tokens_param)
        for j in range(body.n):
            index = p_index * body.n + j
            sampling = _sampling(body, budget, logprobs, j, structured)
            choices.append(Choice(index, p_index, f"{response_id}-{index}", prompt, sampling))
    opts = body.stream_options
    return Generation(
        endpoint=endpoint,
        formatter=Formatter(
            endpoint,
            response_id,
            int(time.time()),
            svc.model_name,
            include_usage=bool(body.stream and opts and opts.include_usage),
        ),
        choices=tuple(choices),
        num_prompt_tokens=sum(len(p) for p in prompts),
        stream=body.stream,
        continuous_usage=bool(body.stream and opts and opts.continuous_usage_stats),
        logprobs=logprobs is not None,
        shape=shape or ShapeSpec(),
        slo=_slo(body),
        priority=Priority(body.priority),
    )


def _slo(body: ChatCompletionRequest | CompletionRequest) -> SLO:
    if body.slo is None:
        return SLO()
    ttft_ms, tpot_ms = body.slo.ttft_ms, body.slo.tpot_ms
    return SLO(
        ttft_s=None if ttft_ms is None else ttft_ms / 1e3,
        tpot_s=None if tpot_ms is None else tpot_ms / 1e3,
    )


def prepare_chat(
    svc: GatewayService,
    body: ChatCompletionRequest,
    prompt: tuple[int, ...],
    images: tuple[ImageInput, ...] = (),
) -> Generation:
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    tools = tool_mode(body)
    gw = svc.settings.gateway
    shape = ShapeSpec(
        tools,
        gw.reasoning_parser,
        gw.tool_call_parser,
        body.include_reasoning,
        hf_tokenizer=getattr(svc.tokenizer, "hf_tokenizer", None),
    )
    gen = _generation(svc, "chat", body, [prompt], max_tokens, logprobs, "messages", tools, shape)
    return replace(gen, images=images)


def prepare_completion(
    svc: GatewayService, body: CompletionRequest, prompts: Sequence[tuple[int, ...]]
) -> Generation:
    if not prompts:
        raise BadRequest("the prompt is empty", "prompt")
    echo_only = body.max_tokens == 0
    if echo_only and not body.echo:
        raise BadRequest(
            "max_tokens must be at least 1 (0 only with echo: the prompt, scored with "
            "logprobs, and nothing generated)",
            "max_tokens",
        )
    max_tokens = 1 if echo_only else body.max_tokens
    gen = _generation(svc, "completion", body, prompts, max_tokens, body.logprobs, "prompt")
    gen = replace(gen, echo_only=echo_only)
    if body.echo:
        echo = tuple(svc.tokenizer.decode(p) for p in prompts)
        gen = replace(gen, echo_texts=echo)
        if body.logprobs is not None:  # the echoed tokens get theirs, as vLLM gives them
            choices = tuple(
                replace(c, sampling=replace(c.sampling, prompt_logprobs=body.logprobs))
                for c in gen.choices
            )
            gen = replace(gen, choices=choices, prompt_logprobs=True)
    return gen
