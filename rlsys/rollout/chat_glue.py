"""The tokens between a model's turns in a multi-turn trajectory, from its own chat template.

After an assistant turn that called tools, the sequence continues with: whatever closes the assistant
turn that the model did not generate (a turn stopped at ``</tool_call>`` lacks ``<|im_end|>\\n``), the
tool messages as the template renders them, and the generation prompt of the next assistant turn. Only
these glue tokens are tokenized; the model's own tokens are kept exactly as sampled, so the trainer
scores the very ids the engine produced (re-tokenizing the whole conversation would drift: a BPE merge
across a turn boundary changes the ids, and with them the log-probs).

The tool messages and the next generation prompt are the difference of two renderings of a fixed
conversation, a user turn with and without the tool messages after it, so they do not depend on what the
model wrote, nor on how a template renders an assistant turn by its position (Qwen3's adds an empty
``<think>`` block to the last assistant turn only). What closes an assistant turn is what a rendered
assistant message has after its content. A template whose rendering with the tool messages does not
extend the one without cannot be cut this way and is refused with the reason.
"""

from __future__ import annotations

from rlsys.errors import ConfigError

_USER, _ASSISTANT = "USER_TURN", "ASSISTANT_TURN"


class ChatGlue:
    def __init__(self, tokenizer, templated: bool):
        self.tokenizer = tokenizer
        self.templated = templated and bool(getattr(tokenizer, "chat_template", None))
        if self.templated:
            turn = self._render([{"role": "assistant", "content": _ASSISTANT}], generation_prompt=False)
            at = turn.rfind(_ASSISTANT)
            if at < 0:
                raise ConfigError("data.chat_template", "the chat template drops the assistant's message content")
            self.turn_end = turn[at + len(_ASSISTANT) :]  # e.g. "<|im_end|>\n"
            self.base = self._render([], generation_prompt=False)

    def _render(self, after_user: list[dict], generation_prompt: bool) -> str:
        messages = [{"role": "user", "content": _USER}, *after_user]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text(self, turn_text: str, observations: list[str]) -> str:
        """The glue after an assistant turn whose decoded text (special tokens kept) is ``turn_text``."""
        if not self.templated:
            body = "\n".join(observations)
            return f"\n<tool_response>\n{body}\n</tool_response>\n"
        full = self._render([{"role": "tool", "content": t} for t in observations], generation_prompt=True)
        if not full.startswith(self.base):
            raise ConfigError(
                "rollout.multi_turn",
                "the chat template renders the conversation before a tool message differently once the tool "
                "message follows, so the turns cannot be appended token for token; use data.chat_template: "
                "plain or another template",
            )
        done = _overlap(turn_text, self.turn_end)  # the part of the turn's end the model generated itself
        return self.turn_end[done:] + full[len(self.base) :]

    def ids(self, turn_text: str, observations: list[str]) -> list[int]:
        return list(self.tokenizer.encode(self.text(turn_text, observations), add_special_tokens=False))


def _overlap(text: str, end: str) -> int:
    """The length of the longest suffix of ``text`` that is a prefix of ``end``."""
    for k in range(min(len(text), len(end)), 0, -1):
        if text.endswith(end[:k]):
            return k
    return 0
