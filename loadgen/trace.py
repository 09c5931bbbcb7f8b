"""Replay recorded workloads: Mooncake-style JSONL traces and ShareGPT files.

Mooncake trace: one JSON object per line with ``timestamp`` (milliseconds from
the trace start), ``input_length``, ``output_length`` and optional
``hash_ids`` (one id per block of 512 prompt tokens, shared ids = shared
prefix). ShareGPT: a JSON list of ``{"conversations": [{"from": "human" |
"gpt", "value": text}, ...]}``; each human turn followed by a gpt turn becomes
one request whose prompt is the conversation so far and whose output length
is the gpt turn's length. Lengths of ShareGPT text are counted with
``count_tokens`` (default: UTF-8 bytes, exact for the byte-level tiny model,
approximate otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from loadgen.workload import RequestSpec, WorkloadError

__all__ = ["MOONCAKE_BLOCK_TOKENS", "load_mooncake", "load_sharegpt", "load_workload_file"]

MOONCAKE_BLOCK_TOKENS = 512


def byte_count(text: str) -> int:
    return max(len(text.encode("utf-8")), 1)


def load_mooncake(path: Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[RequestSpec]:
    out: list[RequestSpec] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                spec = RequestSpec(
                    request_id=f"trace-{len(out)}",
                    arrival_s=float(row["timestamp"]) / 1000.0,
                    input_len=int(row["input_length"]),
                    output_len=max(int(row["output_length"]), 1),
                    hash_ids=tuple(int(h) for h in row.get("hash_ids", ())),
                    hash_block_size=block_tokens,
                )
            except (KeyError, ValueError, TypeError) as e:
                raise WorkloadError(f"{path}:{lineno}: bad trace row ({e!r})") from None
            if spec.input_len < 1:
                raise WorkloadError(f"{path}:{lineno}: input_length must be >= 1")
            out.append(spec)
    if not out:
        raise WorkloadError(f"{path}: empty trace")
    t0 = min(s.arrival_s for s in out)
    out.sort(key=lambda s: s.arrival_s)
    return [_shift(s, t0) for s in out]


def _shift(spec: RequestSpec, t0: float) -> RequestSpec:
    return RequestSpec(
        spec.request_id,
        spec.arrival_s - t0,
        spec.input_len,
        spec.output_len,
        spec.hash_ids,
        spec.hash_block_size,
    )


def load_sharegpt(
    path: Path, count_tokens: Callable[[str], int] = byte_count, max_input_len: int | None = None
) -> list[RequestSpec]:
    """Requests from a ShareGPT file, in file order, arrival times left at 0."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of conversations")
    out: list[RequestSpec] = []
    for session, conv in enumerate(data):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise WorkloadError(f"{path}: conversation {session} has no 'conversations' list")
        history = ""
        for i in range(len(turns) - 1):
            ask, answer = turns[i], turns[i + 1]
            if ask.get("from") != "human" or answer.get("from") != "gpt":
                continue
            prompt = history + str(ask.get("value", ""))
            input_len = count_tokens(prompt)
            if max_input_len is None or input_len <= max_input_len:
                out.append(
                    RequestSpec(
                        request_id=f"sharegpt-{session}-{i}",
                        arrival_s=0.0,
                        input_len=input_len,
                        output_len=count_tokens(str(answer.get("value", ""))),
                        prompt=prompt,
                        session_id=session,
                        turn=i // 2,
                    )
                )
            history = prompt + "\n" + str(answer.get("value", "")) + "\n"
    if not out:
        raise WorkloadError(f"{path}: no human/gpt turn pairs")
    return out


def load_workload_file(path: Path) -> list[RequestSpec]:
    """``.jsonl`` is a Mooncake trace; ``.json`` a ShareGPT file."""
    if not path.exists():
        raise WorkloadError(f"workload file {path} does not exist")
    if path.suffix == ".jsonl":
        return load_mooncake(path)
    if path.suffix == ".json":
        return load_sharegpt(path)
    raise WorkloadError(
        f"workload file {path}: expected .jsonl (Mooncake trace) or .json (ShareGPT)"
    )
