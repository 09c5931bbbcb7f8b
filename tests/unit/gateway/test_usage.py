"""usage's prompt_tokens_details: the prompt tokens a prefix cache served."""

from __future__ import annotations

from types import SimpleNamespace

from services.gateway.respond import _cached_tokens


def test_cached_tokens_count_each_prompt_once_at_its_fewest() -> None:
    """usage counts each prompt once; its choices are separate engine requests that may
    find different amounts cached (the second often finds the first's blocks): usage
    says the fewest, never more than every choice reused."""
    choices = [SimpleNamespace(prompt_index=p) for p in (0, 0, 1, 1)]
    timers = [SimpleNamespace(num_cached_tokens=n) for n in (0, 48, 32, 16)]
    gen = SimpleNamespace(choices=choices)
    assert _cached_tokens(gen, timers) == 0 + 16  # type: ignore[arg-type]
