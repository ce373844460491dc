"""Real ``transformers`` tokenizers with chat templates in the Qwen/Hermes and Llama 3 styles, byte-level so
every text round-trips exactly (the multi-turn and OpenAI-endpoint tests share them)."""

from __future__ import annotations

QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_LIKE = (
    "<|begin_of_text|>{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{# <|python_tag|> #}"
)
SPECIALS = {
    "qwen": ["<|im_start|>", "<|im_end|>"],
    "llama": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
}


def byte_tokenizer(kind: str):
    """A byte-level tokenizer (every text round-trips exactly) with the chat template of ``kind``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    eos = "<|im_end|>" if kind == "qwen" else "<|eot_id|>"
    fast.add_special_tokens({"eos_token": eos, "additional_special_tokens": SPECIALS[kind]})
    fast.chat_template = QWEN_LIKE if kind == "qwen" else LLAMA_LIKE
    return fast


TEMPLATE = (  # user turns open with w1, assistant turns with w3 (the generation prompt), tool output in w10 .. w11
    "{% for m in messages %}{% if m.role == 'tool' %}w10 {{ m.content }} w11 "
    "{% elif m.role == 'assistant' %}w3 {{ m.content }}<|end|> {% else %}w1 {{ m.content }}<|end|> {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
)


def word_chat_tokenizer():
    """Words w0..w999 and <|end|> (EOS), one per id of the tiny checkpoints' 1001: any sampled ids decode to
    text that encodes back to them. User turns open with w1, assistant turns with w3, tool output is
    wrapped in w10 .. w11."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(1000)} | {"<|end|>": 1000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|end|>"})
    fast.chat_template = TEMPLATE
    return fast


def two_turn_agent(base_url: str, record: dict) -> str:
    """An agent as users write them, with the official client: ask, give the model a tool's answer, ask
    again; the second reply is the final answer."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": record["prompt"]}]
    first = client.chat.completions.create(model="rlsys", messages=messages, max_tokens=4)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "tool", "content": "w4 w5"})
    second = client.chat.completions.create(model="rlsys", messages=messages, max_tokens=4)
    return second.choices[0].message.content
