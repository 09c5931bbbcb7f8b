"""The ``vllm`` backend: vLLM's v1 engine, in-process, behind Baton's Engine protocol.

``engine.py`` holds the adapter (it imports vLLM and is loaded only when a vLLM
worker starts); ``options.py`` checks an ``engine.vllm`` mapping by name.
"""

from __future__ import annotations

from services.backends.vllm.options import check_vllm_options

__all__ = ["check_vllm_options"]
