"""Tools and the history's tool calls reach a Hugging Face chat template (token ids)."""

from __future__ import annotations

import json
from pathlib import Path

from services.engine.tokenizer import HFTokenizer
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.tokens import chat_prompt_ids
from tests.unit.engine.conftest import save_word_tokenizer

# Renders what a tool-aware template renders: the tools, each call's name and a dict
# argument (so arguments must arrive as dicts), and the tool's answer.
TEMPLATE = (
    "{% for t in tools or [] %}<|user|> {{ t.function.name }} {% endfor %}"
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} "
    "{% for c in m.tool_calls or [] %}{{ c.function.name }} {{ c.function.arguments.where }} "
    "{% endfor %}</s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def test_tools_and_tool_calls_are_in_the_prompt(tmp_path: Path) -> None:
    save_word_tokenizer(tmp_path, 64)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = HFTokenizer(tmp_path)
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "cat"}}],
            "messages": [
                {"role": "user", "content": "hello"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "sat", "arguments": '{"where": "mat"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "world"},
            ],
        }
    )
    ids = chat_prompt_ids(tok, body.chat_messages(), body.template_tools())
    words = ["<|user|>", "cat", "<|user|>", "hello", "</s>", "<|assistant|>", "sat", "mat"]
    assert list(ids[: len(words)]) == [tok.encode(w, add_special_tokens=False)[0] for w in words]
    assert tok.encode("world", add_special_tokens=False)[0] in ids
    # tool_choice none: the tools stay out of the prompt.
    none = body.model_copy(update={"tool_choice": "none"})
    assert len(chat_prompt_ids(tok, none.chat_messages(), none.template_tools())) == len(ids) - 2
