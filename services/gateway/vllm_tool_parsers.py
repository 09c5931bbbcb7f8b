"""vLLM's registered tool parsers, by name, behind the gateway's ToolParser protocol.

``--tool-call-parser NAME`` picks one of ours (``hermes``, ``llama3_json``) first; any other
name is looked up in vLLM's ``ToolParserManager`` when vLLM is installed. A vLLM parser
sees the whole text of a choice (its ``extract_tool_calls``), so through this adapter a
streamed answer carries its content and calls when the choice ends, not before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.gateway.parsers import Parsed

__all__ = ["VllmToolParser", "vllm_tool_parser_names"]


def vllm_tool_parser_names() -> list[str]:
    """Names vLLM registers; empty when vLLM is not installed."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        return []
    names: list[str] = ToolParserManager.list_registered()
    return names


class VllmToolParser:
    def __init__(self, name: str, tokenizer: Any, tools: Sequence[dict[str, Any]]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        self._request = ChatCompletionRequest.model_validate(
            {
                "model": "baton",
                "messages": [{"role": "user", "content": ""}],
                "tools": list(tools) or None,
            }
        )
        parser_cls: Any = ToolParserManager.get_tool_parser(name)
        self._parser = parser_cls(tokenizer, self._request.tools)
        self._text = ""

    def feed(self, text: str) -> Parsed:
        self._text += text
        return Parsed()

    def finish(self) -> Parsed:
        text, self._text = self._text, ""
        info = self._parser.extract_tool_calls(text, self._request)
        if not info.tools_called:
            return Parsed(content=text)
        calls = [(c.function.name, c.function.arguments) for c in info.tool_calls]
        return Parsed(content=info.content or "", calls=calls)
