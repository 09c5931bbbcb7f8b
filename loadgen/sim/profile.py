"""Profiles for the simulator: the router's ``Profile`` (router/profile.py), found by name.

``load_profile(None)`` loads the shipped ``tiny-cpu.json``; a bare name such as
``llama3-8b-h100`` loads ``loadgen/profiles/<name>.json``; anything else is a
path. The JSON format and the meaning of each coefficient are documented in
``router.profile``. A batched prefill of several prompts is costed by the
simulator as ``a + Σ(b·n_i + c·n_i²)`` (attention is quadratic per sequence,
the rest linear in the total).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from router.profile import Profile, QuadCoeffs, TransferCoeffs

__all__ = ["DEFAULT_PROFILE", "Profile", "QuadCoeffs", "TransferCoeffs", "load_profile"]

DEFAULT_PROFILE = "tiny-cpu"


def load_profile(name_or_path: str | Path | None = None) -> Profile:
    path = Path(name_or_path) if name_or_path is not None else None
    if path is not None and (path.exists() or len(path.parts) > 1):
        text, source = path.read_text(), str(path)
    else:
        name = str(name_or_path or DEFAULT_PROFILE)
        name = name if name.endswith(".json") else name + ".json"
        shipped = resources.files("loadgen.profiles").joinpath(name)
        if not shipped.is_file():
            raise FileNotFoundError(
                f"no profile file {name_or_path!s} and no shipped profile {name}"
            )
        text, source = shipped.read_text(), f"loadgen/profiles/{name}"
    try:
        return Profile.from_dict(json.loads(text))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None
