"""Prompt datasets (JSONL, JSON, Parquet, synthetic), templates, filtering, and the epoch sampler."""

import json
import logging
from dataclasses import replace

import pytest

from rlsys.config import DataConfig
from rlsys.data import EpochSampler, PromptDataset, SyntheticTokenizer, load_records
from rlsys.errors import ConfigError

RECORDS = [
    {"question": "copy a b =", "meta": {"gt": "a b"}, "id": 0},
    {"question": "copy c =", "meta": {"gt": "c"}, "id": 1},
    {"question": "copy a b c d e f g h =", "meta": {"gt": "a b c d e f g h"}, "id": 2},
]


def _cfg(path, **kw):
    return replace(DataConfig(path=str(path), prompt_key="question", answer_key="meta.gt"), **kw)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    return path


def test_jsonl_records_keys_and_nested_answer(jsonl):
    ds = PromptDataset.from_config(_cfg(jsonl), SyntheticTokenizer())
    assert len(ds) == 3 and ds.dropped == 0
    p = ds[1]
    assert (p.index, p.text, p.answer, p.record["id"]) == (1, "copy c =", "c", 1)
    assert p.ids == SyntheticTokenizer().encode("copy c =")
    assert [x.index for x in ds.batch([2, 0])] == [2, 0]


def test_json_list_and_parquet_and_directory(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "a.json").write_text(json.dumps(RECORDS[:1]))
    pq.write_table(pa.Table.from_pylist(RECORDS[1:]), tmp_path / "b.parquet")
    assert load_records(str(tmp_path / "a.json")) == RECORDS[:1]
    assert load_records(str(tmp_path / "b.parquet")) == RECORDS[1:]
    assert [r["id"] for r in load_records(str(tmp_path))] == [0, 1, 2]  # a directory: files in name order


def test_missing_file_and_keys_name_the_config_key(tmp_path, jsonl):
    tok = SyntheticTokenizer()
    with pytest.raises(ConfigError, match="data.path.*no such file"):
        PromptDataset.from_config(_cfg(tmp_path / "nope.jsonl"), tok)
    with pytest.raises(ConfigError, match=r"data.prompt_key.*'prompt'.*available keys: \['id', 'meta', 'question'\]"):
        PromptDataset.from_config(_cfg(jsonl, prompt_key="prompt"), tok)
    with pytest.raises(ConfigError, match="data.answer_key.*'meta.answer'"):
        PromptDataset.from_config(_cfg(jsonl, answer_key="meta.answer"), tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n{oops\n')
    with pytest.raises(ConfigError, match="bad.jsonl: 1 of 2 lines are not JSON .first: line 2.*data.max_bad_lines"):
        load_records(str(bad))
    bad.write_text("".join(f'{{"question": "{i}"}}\n' for i in range(199)) + "{oops\n")  # 0.5%: skipped
    assert len(load_records(str(bad), max_bad_lines=0.01)) == 199


def test_long_prompts_are_dropped_counted_and_logged(jsonl, caplog):
    with caplog.at_level(logging.WARNING, logger="rlsys.data"):
        ds = PromptDataset.from_config(_cfg(jsonl, max_prompt_len=5), SyntheticTokenizer())
    assert [p.record["id"] for p in ds] == [0, 1] and [p.index for p in ds] == [0, 1]
    assert ds.dropped == 1
    assert "dropped 1 of 3 prompts" in caplog.text and "max_prompt_len=5" in caplog.text
    with pytest.raises(ConfigError, match="data.max_prompt_len"):
        PromptDataset.from_config(_cfg(jsonl, max_prompt_len=2), SyntheticTokenizer())


def _hf_tokenizer_with_template(tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = SyntheticTokenizer().save_pretrained(str(tmp_path / "tok"))
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}a{% endif %}"
    )
    return tok


def test_chat_template_plain_template_and_fallback(jsonl, tmp_path, caplog):
    tok = _hf_tokenizer_with_template(tmp_path)
    ds = PromptDataset.from_config(_cfg(jsonl), tok)
    assert ds[1].text == "user copy c = a"  # rendered as a user turn plus the generation prompt
    assert ds[1].ids == tok.encode("user copy c = a", add_special_tokens=False)

    plain = replace(_cfg(jsonl, chat_template="plain"))
    plain.prompt_template = "b {prompt} c"
    assert PromptDataset.from_config(plain, tok)[1].text == "b copy c = c"
    wrapped = replace(_cfg(jsonl), prompt_template="b {prompt}")  # inside the user turn of the chat template
    assert PromptDataset.from_config(wrapped, tok)[1].text == "user b copy c = a"

    with caplog.at_level(logging.WARNING, logger="rlsys.data"):
        ds = PromptDataset.from_config(_cfg(jsonl), SyntheticTokenizer())  # no chat template
    assert ds[1].text == "copy c =" and "no chat template" in caplog.text


def test_chat_prompts_given_as_messages(tmp_path):
    tok = _hf_tokenizer_with_template(tmp_path)
    records = [{"prompt": [{"role": "system", "content": "b"}, {"role": "user", "content": "copy a ="}], "answer": "a"}]
    ds = PromptDataset(records, tok)
    assert ds[0].text == "system b user copy a = a"
    assert PromptDataset(records, tok, chat_template="plain")[0].text == "b\ncopy a ="


def test_synthetic_dataset_when_no_path():
    cfg = DataConfig(path=None, prompt_key="ignored")
    train = PromptDataset.from_config(cfg, SyntheticTokenizer(), seed=3)
    evals = PromptDataset.from_config(cfg, SyntheticTokenizer(), split="eval", seed=3)
    assert len(train) == 4096 and len(evals) == 64
    assert {p.text for p in train}.isdisjoint({p.text for p in evals})
    assert PromptDataset.from_config(DataConfig(path="x.jsonl"), SyntheticTokenizer(), split="eval") is None


# ------------------------------------------------------------------ sampler


def test_sampler_visits_each_index_once_per_epoch_and_crosses_epochs():
    s = EpochSampler(10, seed=1)
    first = s.next_batch(4) + s.next_batch(4)
    crossing = s.next_batch(4)  # 2 from epoch 0, 2 from epoch 1
    assert sorted(first + crossing[:2]) == list(range(10))
    assert s.epoch == 1 and s.position == 2 and s.samples_seen == 12
    assert len(s.next_batch(25)) == 25 and s.epoch == 3  # batches larger than the dataset work too


def test_sampler_is_seeded_and_shuffles_differently_per_epoch():
    a, b, c = EpochSampler(50, seed=7), EpochSampler(50, seed=7), EpochSampler(50, seed=8)
    ea, eb, ec = a.next_batch(50), b.next_batch(50), c.next_batch(50)
    assert ea == eb and ea != ec and ea != list(range(50))
    assert a.next_batch(50) != ea
    assert EpochSampler(5, shuffle=False).next_batch(7) == [0, 1, 2, 3, 4, 0, 1]


def test_sampler_resumes_exactly():
    ref = EpochSampler(13, seed=5)
    stream = [ref.next_batch(4) for _ in range(10)]
    s = EpochSampler(13, seed=5)
    for _ in range(4):
        s.next_batch(4)
    state = json.loads(json.dumps(s.state_dict()))  # checkpoints store it as plain data
    resumed = EpochSampler(13, seed=999)  # the checkpoint's seed wins: the position refers to its order
    resumed.load_state_dict(state)
    assert [resumed.next_batch(4) for _ in range(6)] == stream[4:]
    with pytest.raises(ValueError, match="dataset of 13 prompts, this one has 12"):
        EpochSampler(12).load_state_dict(state)
