"""Tool calls in a model's text, in the format its chat template teaches.

- ``hermes``: Qwen2.5/Qwen3, Hermes, SmolLM2 and most open models: ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call. Generation stops at ``</tool_call>``.
- ``llama3``: Llama 3.1-3.3: the turn is one JSON object ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``; several calls are separated by ``;``. Generation stops at ``<|eom_id|>`` or EOS.
- ``tags``: Search-R1 style for models without a tool-calling template (and the tiny synthetic task): the
  text between ``<tool_call>`` and ``</tool_call>`` is the single argument of the environment's first tool.

``auto`` picks ``hermes`` or ``llama3`` from the tokenizer's chat template, and ``tags`` without one.
A call that does not parse is returned as a ``ToolCall`` with ``error`` set, so the environment answers
with an error observation and the model learns from it; it never fails the step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3", "tags")
# a block's body runs from the last opening tag before its closing one (a call the model started over is the
# one it finished); an unclosed block was cut off and is not a call
_HERMES = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be parsed; name may then be empty


@dataclass(frozen=True)
class ToolFormat:
    name: str  # one of FORMATS
    stop: tuple[str, ...] = ()  # stop strings that end a turn at the end of a call
    stop_tokens: tuple[str, ...] = ()  # special tokens that end a call turn (besides EOS)

    def parse(self, text: str, default_tool: str = "") -> list[ToolCall]:
        """The calls in one assistant turn's ``text``; empty when the turn is a final answer."""
        if self.name == "hermes":
            return [_json_call(body, "arguments") for body in _HERMES.findall(text)]
        if self.name == "llama3":
            return _llama3_calls(text)
        return [ToolCall(default_tool, {"input": body.strip()}) for body in _HERMES.findall(text)]


def tool_format(name: str, tokenizer=None) -> ToolFormat:
    """The format ``name`` (``auto``: from ``tokenizer``'s chat template)."""
    if name == "auto":
        template = str(getattr(tokenizer, "chat_template", None) or "")
        name = "hermes" if "<tool_call>" in template else "llama3" if "<|python_tag|>" in template else "tags"
        if name == "tags" and template:
            name = "hermes"  # a chat template with no tool format of its own: Hermes blocks in plain text
    if name == "hermes":
        return ToolFormat("hermes", stop=("</tool_call>",))
    if name == "llama3":
        return ToolFormat("llama3", stop_tokens=("<|eom_id|>",))
    if name == "tags":
        return ToolFormat("tags", stop=("</tool_call>",))
    raise ValueError(f"unknown tool format {name!r}; choose auto or one of {', '.join(FORMATS)}")


def _json_call(body: str, args_key: str) -> ToolCall:
    body = body.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at position {e.pos}): {body[:200]}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error=f'a tool call needs {{"name": ..., "{args_key}": {{...}}}}, got: {body[:200]}')
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error=f"the arguments of {obj['name']!r} are not a JSON object: {args[:200]}")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"the arguments of {obj['name']!r} must be a JSON object, got {args!r:.200}")
    return ToolCall(obj["name"], args)


def _llama3_calls(text: str) -> list[ToolCall]:
    body = text.replace("<|python_tag|>", "").replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
    if not body.startswith("{"):
        return []  # prose: a final answer
    calls = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            calls.append(_json_call(body[pos:], "parameters"))  # the error, with the text that failed
            break
        calls.append(_json_call(json.dumps(obj), "parameters"))
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return calls
