"""``baton profile``: measure a running server's prefill and decode curves over HTTP.

Prefill: one request at a time, two output tokens, distinct prompts (so no
prefix-cache hits) of several lengths, each after ``--idle-s`` of quiet (a
request of a light load finds the server idle; one sent the moment the last
finished rides on threads still awake and reads 10-40% fast), stretched at random up
to twice that (so that probes do not fall in step with a worker's periodic telemetry,
whose period restarts at each request's finish: a fixed 0.1 s idle made every probe
land on a snapshot being published, 10.5 vs 8 ms TTFT, which live traffic does not
pay); the median TTFT per length is fitted
to ``a + b·n + c·n²``, and the median gap between the two tokens is the
hand-off (see ``_fit_transfer_latency``). Decode: ``B`` concurrent requests
with prompts of ``L`` tokens, run twice, generating ``T`` and then ``2T``
tokens; the difference of the median end-to-end latencies over the extra
``T`` tokens is one decode step at batch ``B`` and total context about
``B·(L + T)``, fitted to ``a + b·B + c·ΣL``. The difference cancels TTFT and
the hand-off, and it counts tokens, not SSE events (a byte-level model may
send a token with no text yet, which a client cannot time). Least squares
with non-negative coefficients, refitted once without outliers (stalls of a
shared machine).

Run it against a server whose router disaggregates every request (``baton
serve --policy round_robin``): a policy that may colocate (``slo_goodput``)
makes some probes skip the hand-off, and the profile then under-states it.

What HTTP cannot see (KV bytes per token, blocks, transfer link) is copied
from ``--base-profile`` and named as such in ``sources``. TTFT includes the
gateway's own overhead, so the prefill ``a`` is an upper bound on the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from loadgen.client import client_api_key, send_request, served_model
from loadgen.flags import at_least_zero, counts, server_root
from loadgen.sim.profile import Profile, QuadCoeffs, TransferCoeffs, load_profile
from loadgen.workload import RequestSpec

__all__ = ["add_arguments", "counts", "fit_nonnegative", "fit_robust", "measure_profile", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        type=server_root,
        default="http://127.0.0.1:8000",
        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)",
    )
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="completions",
        help="the API the probes use (default: %(default)s)",
    )
    # The probe lists: flag, what each number is, the fewest different ones the fit needs
    # and why, the default, what the probes do with them.
    for flag, what, least, why, default, role in (
        (
            "--prefill-lens",
            "prompt lengths (tokens)",
            3,
            "the fit a + b·n + c·n² has three terms",
            "16,64,128,256,512,1024",
            "prompt lengths of the prefill probes, in tokens",
        ),
        (
            "--decode-batches",
            "batch sizes (requests)",
            2,
            "the step's slope per request is fitted",
            "1,2,4,8,16",
            "concurrent requests of the decode probes",
        ),
        (
            "--decode-contexts",
            "prompt lengths (tokens)",
            2,
            "one length makes context a multiple of the batch",
            "64,512",
            "prompt lengths of the decode probes, in tokens",
        ),
    ):
        parser.add_argument(
            flag,
            type=counts(what, least, why),
            default=default,
            help=f"{role}, comma-separated, at least {least} different (default: %(default)s)",
        )
    parser.add_argument(
        "--decode-tokens",
        type=counts("output tokens", 1, "", single=True),
        default="32",
        help="T: each decode probe runs with T and with 2T output tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=counts("repeats", 1, "", single=True),
        default="3",
        help="runs of each probe; the median counts (default: %(default)s)",
    )
    parser.add_argument(
        "--idle-s",
        type=at_least_zero("seconds"),
        default=0.2,
        help="idle time before each probe (s): a probe must find the server idle, as a "
        "request of a light load does, not on threads still awake from the previous one "
        "(default: %(default)s)",
    )
    parser.add_argument("--hardware", default="unknown", help="free text written into the profile")
    parser.add_argument(
        "--base-profile",
        default=None,
        help="source of the fields HTTP cannot measure: a profile file, or the name of a "
        "shipped one in loadgen/profiles (default: the simulator's default profile)",
    )
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument(
        "--api-key-file",
        help="send the bearer key in this file (default: $BATON_API_KEY, then $OPENAI_API_KEY)",
    )


def fit_nonnegative(features: np.ndarray, times_s: np.ndarray) -> np.ndarray:
    """Least squares ``features @ x ≈ times`` with ``x >= 0`` (drop negative terms, refit)."""
    active = list(range(features.shape[1]))
    coeffs = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(features[:, active], times_s, rcond=None)
        if np.all(sol >= 0):
            coeffs[active] = sol
            return coeffs
        active.pop(int(np.argmin(sol)))
    return coeffs


def fit_robust(features: np.ndarray, times_s: np.ndarray) -> np.ndarray:
    """``fit_nonnegative``, then once more without points far off the fit.

    A shared machine stalls a probe now and then; a point whose residual is
    over three times the median residual (and over 2 ms) is such a stall.
    """
    coeffs = fit_nonnegative(features, times_s)
    residual = np.abs(features @ coeffs - times_s)
    keep = residual <= max(3 * float(np.median(residual)), 0.002)
    if keep.sum() >= features.shape[1] and not keep.all():
        coeffs = fit_nonnegative(features[keep], times_s[keep])
    return coeffs


# What the fitted coefficients are in: TTFT = a + b·n + c·n² over the prompt's n tokens;
# a decode step = a + b·B + c·ΣL over its B requests and their ΣL tokens of context.
COEFF_UNITS = {
    "prefill": {"a": "s", "b": "s/token", "c": "s/token²"},
    "decode": {"a": "s", "b": "s/request", "c": "s/context token"},
}

_JITTER = random.Random(0)


async def _quiet(idle_s: float) -> None:
    """Idle for ``idle_s`` to twice that, at random (see the module docstring)."""
    await asyncio.sleep(idle_s * _JITTER.uniform(1.0, 2.0))


async def _prefill_points(
    client: httpx.AsyncClient,
    url: str,
    kind: str,
    model: str,
    lens: Sequence[int],
    repeats: int,
    idle_s: float,
    say: Callable[[str], None],
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(tokens, median TTFT s) per prompt length, and (tokens, median hand-off gap s):
    the gap between the first and second token, which spans the KV pull to the
    decode worker plus one decode step."""
    points, handoffs = [], []
    for k, n in enumerate(lens, 1):
        ttfts: list[float] = []
        gaps: list[float] = []
        for r in range(repeats + 1):  # the first of each length warms up
            await _quiet(idle_s)
            # Two tokens, so the probe takes a real request's path (prefill-only, hold,
            # first token streamed while decode is planned); TTFT is its first event.
            spec = RequestSpec(f"profile-prefill-{n}-{r}-{time.time_ns()}", 0.0, n, 2)
            rec = await send_request(client, url, kind, model, spec, time.perf_counter())  # type: ignore[arg-type]
            if not rec.success or rec.ttft_s is None:
                raise RuntimeError(f"prefill probe of {n} tokens failed: {rec.error}")
            if r:
                ttfts.append(rec.ttft_s)
                if rec.e2el_s is not None and rec.output_tokens == 2:
                    gaps.append(rec.e2el_s - rec.ttft_s)
        points.append((n, statistics.median(ttfts)))
        if gaps:
            handoffs.append((n, statistics.median(gaps)))
        say(f"prefill {k}/{len(lens)}: {n} tokens, median TTFT {points[-1][1] * 1e3:.1f} ms")
    return points, handoffs


async def _decode_points(
    client: httpx.AsyncClient,
    url: str,
    kind: str,
    model: str,
    batches: Sequence[int],
    contexts: Sequence[int],
    num_tokens: int,
    repeats: int,
    idle_s: float,
    say: Callable[[str], None],
) -> list[tuple[int, int, float]]:
    """(batch, total context tokens, step s) per probe: see the module docstring."""

    async def round_e2el(batch: int, ctx: int, tokens: int) -> float:
        specs = [
            RequestSpec(
                f"profile-decode-{batch}-{ctx}-{tokens}-{i}-{time.time_ns()}", 0.0, ctx, tokens
            )
            for i in range(batch)
        ]
        await _quiet(idle_s)
        start = time.perf_counter()
        recs = await asyncio.gather(
            *(send_request(client, url, kind, model, s, start) for s in specs)  # type: ignore[arg-type]
        )
        if not all(r.success and r.e2el_s is not None for r in recs):
            raise RuntimeError(f"decode probe B={batch} L={ctx} failed: {recs[0].error}")
        return statistics.median(r.e2el_s for r in recs if r.e2el_s is not None)

    points = []
    total = len(contexts) * len(batches)
    for ctx in contexts:
        for batch in batches:
            steps = []
            for _ in range(max(1, repeats)):
                short = await round_e2el(batch, ctx, num_tokens)
                long = await round_e2el(batch, ctx, 2 * num_tokens)
                steps.append((long - short) / num_tokens)
            points.append((batch, batch * (ctx + num_tokens), max(0.0, statistics.median(steps))))
            say(
                f"decode {len(points)}/{total}: batch {batch}, {ctx}-token prompts, "
                f"step {points[-1][2] * 1e3:.2f} ms"
            )
    return points


async def measure_profile(
    args: argparse.Namespace, progress: Callable[[str], None] | None = None
) -> Profile:
    """The profile of the server at ``args.base_url``; ``progress`` sees a line per
    prompt length and per decode probe as each is measured."""
    say = progress or (lambda _: None)
    base = args.base_url.rstrip("/")
    kind = args.endpoint
    url = f"{base}/v1/chat/completions" if kind == "chat" else f"{base}/v1/completions"
    key = client_api_key(getattr(args, "api_key_file", None), os.environ)
    headers = {"Authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(600.0, connect=30.0)
    seed = load_profile(args.base_profile)  # a missing file fails now, not after the probes
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        model = await served_model(client, base, args.model)
        prefill, handoffs = await _prefill_points(
            client, url, kind, model, args.prefill_lens, args.repeats, args.idle_s, say
        )
        decode = await _decode_points(
            client,
            url,
            kind,
            model,
            args.decode_batches,
            args.decode_contexts,
            args.decode_tokens,
            args.repeats,
            args.idle_s,
            say,
        )
    n = np.array([p[0] for p in prefill], dtype=float)
    p_coeffs = fit_robust(
        np.stack([np.ones_like(n), n, n * n], axis=1), np.array([p[1] for p in prefill])
    )
    b = np.array([p[0] for p in decode], dtype=float)
    ctx = np.array([p[1] for p in decode], dtype=float)
    d_coeffs = fit_robust(
        np.stack([np.ones_like(b), b, ctx], axis=1), np.array([p[2] for p in decode])
    )
    transfer = _fit_transfer_latency(handoffs, d_coeffs, seed)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sources = (
        f"prefill and decode measured by `baton profile` against {base} (model {model}) at {when}",
        "prefill points (tokens, median TTFT s): "
        + json.dumps([[int(a), round(t, 6)] for a, t in prefill]),
        "decode points (batch, context tokens, step s from the end-to-end difference of "
        f"{args.decode_tokens} and {2 * args.decode_tokens} output tokens): "
        + json.dumps([[int(a), int(c), round(t, 6)] for a, c, t in decode]),
        "prefill includes the server's HTTP and scheduling overhead (TTFT of a 2-token request)",
        "transfer latency: median hand-off gap (first to second token) minus one decode step "
        "and the bytes at the base profile's bandwidth: "
        + json.dumps([[int(a), round(t, 6)] for a, t in handoffs]),
        f"transfer bandwidth, kv_bytes_per_token, num_kv_blocks, block_size, max_num_seqs copied from {seed.model} base profile:",
        *seed.sources,
    )
    return replace(
        seed,
        model=model,
        hardware=args.hardware,
        prefill=QuadCoeffs(*(float(x) for x in p_coeffs)),
        decode=QuadCoeffs(*(float(x) for x in d_coeffs)),
        transfer=transfer,
        sources=sources,
    )


def _fit_transfer_latency(
    handoffs: Sequence[tuple[int, float]], d_coeffs: np.ndarray, seed: Profile
) -> TransferCoeffs:
    """The fixed cost of handing a request from prefill to decode, seen over HTTP.

    Each gap = latency + n·kv_bytes_per_token/bandwidth + one decode step (batch 1,
    context n); what is left after the modelled parts is the latency (never negative).
    """
    bw = seed.transfer.bandwidth_bytes_per_s
    rest = [
        gap - n * seed.kv_bytes_per_token / bw - (d_coeffs[0] + d_coeffs[1] + d_coeffs[2] * n)
        for n, gap in handoffs
    ]
    latency_s = max(0.0, statistics.median(rest)) if rest else seed.transfer.latency_s
    return TransferCoeffs(bandwidth_bytes_per_s=bw, latency_s=float(latency_s))


def _to_stderr(line: str) -> None:
    print(f"baton profile: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        profile = asyncio.run(measure_profile(args, progress=_to_stderr))
    except ValueError as e:  # an empty --api-key-file, a --model the server does not serve
        print(f"baton profile: {e}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, OSError, RuntimeError) as e:
        print(f"baton profile: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = profile.to_dict() | {"estimated": False}
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    summary = {
        "prefill": data["prefill"],
        "decode": data["decode"],
        "units": COEFF_UNITS,
        "out": str(args.out),
    }
    print(json.dumps(summary, ensure_ascii=False))
    return 0
