"""Bad input to ``rlsys train``, as users give it: each case is one line naming the problem and the fix
(the config key or the file), exit code 2, and nothing written (no output directory appears)."""

import json
import os

import pytest
from tiny_models import make_tiny_hf_checkpoint, save_word_tokenizer

from rlsys.cli import main

CONFIG = "configs/tiny-cpu-grpo.yaml"
ONE_RANK = ["actor.parallel.tp=1", "cluster.devices_per_node=1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    f = {"root": str(root)}
    f["model"] = make_tiny_hf_checkpoint("llama", str(root / "model"))
    save_word_tokenizer(f["model"])
    f["no_tokenizer"] = make_tiny_hf_checkpoint("llama", str(root / "no_tokenizer"))
    f["truncated"] = make_tiny_hf_checkpoint("llama", str(root / "truncated"))
    save_word_tokenizer(f["truncated"])
    weights = root / "truncated" / "model-00003-of-00005.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # an interrupted download
    for name, content in {
        "no_config": None,
        "bad_config": "{not json",
        "bert": json.dumps({"model_type": "bert", "architectures": ["BertModel"]}),
        "empty_dir": None,
    }.items():
        os.makedirs(root / name)
        f[name] = str(root / name)
        if content is not None:
            (root / name / "config.json").write_text(content)
    texts = {
        "empty.jsonl": "",
        "broken.jsonl": '{"prompt": "w1", "answer": "w2"}\n{oops\n{"prompt": \n',
        "no_key.jsonl": '{"question": "w1", "answer": "w2"}\n',
        "not_objects.jsonl": '["w1"]\n["w2"]\n',
        "long.jsonl": json.dumps({"prompt": " ".join(["w5"] * 300), "answer": "w1"}) + "\n",
        "good.jsonl": "".join(json.dumps({"prompt": f"w{i} w{i + 1}", "answer": f"w{i}"}) + "\n" for i in range(1, 9)),
        "data.txt": "w1 w2\n",
        "truncated.parquet": "PAR1 not really",
        "malformed.yaml": "actor: [1,\n",
        "list.yaml": "- a\n- b\n",
        "scalar.yaml": "42\n",
        "typo.yaml": "trainer:\n  stepz: 3\n",
        "nested_typo.yaml": "actor:\n  optimizer:\n    learning_rate: 1.0e-6\n",
    }
    for name, text in texts.items():
        (root / name).write_text(text)
        f[name] = str(root / name)
    return f


def data(f, name, *more):
    return [f"data.path={f[name]}", f"model.path={f['model']}", "model.hf_config=null", *more]


# (id, config file or None for CONFIG, overrides from the files, fragments the one line must hold)
CASES = [
    # configs
    ("malformed yaml", "malformed.yaml", lambda f: [], ["malformed.yaml", "YAML"]),
    ("config is a list", "list.yaml", lambda f: [], ["list.yaml", "mapping"]),
    ("config is a number", "scalar.yaml", lambda f: [], ["scalar.yaml", "mapping"]),
    ("config is a directory", "root", lambda f: [], ["Is a directory"]),
    ("config missing", "missing.yaml", lambda f: [], ["missing.yaml", "No such file"]),
    ("unknown key in file", "typo.yaml", lambda f: [], ["trainer.stepz", "did you mean 'steps'"]),
    ("nested unknown key", "nested_typo.yaml", lambda f: [], ["actor.optimizer.learning_rate", "valid keys"]),
    ("unknown key override", None, lambda f: ["rollout.sampling.temprature=1"], ["rollout.sampling.temprature"]),
    ("wrong type", None, lambda f: ["trainer.steps=abc"], ["trainer.steps", "expected int"]),
    ("wrong literal", None, lambda f: ["rollout.sync.senders=all"], ["rollout.sync.senders", "'stages', 'writers'"]),
    ("unknown engine", None, lambda f: ["rollout.engine=vllm"], ["rollout.engine", "cpu, sglang", "package.module"]),
    ("moved engine key", None, lambda f: ["rollout.sglang_args=[--x]"], ["rollout.sglang.args"]),
    ("negative steps", None, lambda f: ["trainer.steps=-1"], ["trainer.steps", ">= 1"]),
    ("override without =", None, lambda f: ["trainer.steps"], ["key.path=value"]),
    ("bad lr type", None, lambda f: ["actor.optimizer.lr=fast"], ["actor.optimizer.lr", "float"]),
    ("moved key", None, lambda f: ["algorithm.clip_low=0.2"], ["algorithm.clip_low"]),
    ("impossible layout", None, lambda f: ["actor.parallel.tp=3"], ["actor"]),
    ("too many engines", None, lambda f: ["rollout.num_engines=9"], ["rollout.num_engines", "devices"]),
    ("grpo with n=1", None, lambda f: ["rollout.sampling.n=1"], ["n >= 2"]),
    ("bad-lines share", None, lambda f: ["data.max_bad_lines=2"], ["data.max_bad_lines"]),
    ("bad-steps", None, lambda f: ["trainer.max_bad_steps=-1"], ["trainer.max_bad_steps"]),
    (
        "delta with released weights",
        None,
        lambda f: ["rollout.sync.delta=true", "rollout.release_memory=true", "cluster.colocate=true"],
        ["rollout.sync.delta", "rollout.release_memory: false"],
    ),  # fmt: skip
    # data
    ("data missing", None, lambda f: data(f, "root", "data.path=/nonexistent/train.jsonl"), ["data.path", "no such"]),
    ("data empty", None, lambda f: data(f, "empty.jsonl"), ["data.path", "empty.jsonl"]),
    ("data corrupt lines", None, lambda f: data(f, "broken.jsonl"), ["broken.jsonl", "2 of 3 lines", "max_bad_lines"]),
    ("data missing key", None, lambda f: data(f, "no_key.jsonl"), ["data.prompt_key", "question"]),
    ("data not objects", None, lambda f: data(f, "not_objects.jsonl"), ["data.path", "JSON object"]),
    ("data all too long", None, lambda f: data(f, "long.jsonl", "data.max_prompt_len=64"), ["max_prompt_len"]),
    ("data wrong extension", None, lambda f: data(f, "data.txt"), ["data.path", ".jsonl"]),
    ("data corrupt parquet", None, lambda f: data(f, "truncated.parquet"), ["truncated.parquet", "parquet"]),
    ("data dir without files", None, lambda f: data(f, "empty_dir"), ["data.path", "has no"]),
    ("eval data missing", None, lambda f: data(f, "good.jsonl", "data.eval_path=/nonexistent/e.jsonl"), ["data"]),
    ("data without model", None, lambda f: [f"data.path={f['good.jsonl']}"], ["model.path", "tokenizer"]),
    # models
    ("model dir missing", None, lambda f: ["model.path=/nonexistent/model", "model.hf_config=null"], ["model.path"]),
    (
        "model without config.json",
        None,
        lambda f: [f"model.path={f['no_config']}", "model.hf_config=null"],
        ["no_config", "config.json"],
    ),  # fmt: skip
    (
        "model config not json",
        None,
        lambda f: [f"model.path={f['bad_config']}", "model.hf_config=null"],
        ["bad_config", "config.json"],
    ),  # fmt: skip
    (
        "unsupported architecture",
        None,
        lambda f: [f"model.path={f['bert']}", "model.hf_config=null"],
        ["bert", "supported"],
    ),  # fmt: skip
    (
        "model without tokenizer",
        None,
        lambda f: data(f, "good.jsonl", f"model.path={f['no_tokenizer']}"),
        ["model.path", "tokenizer"],
    ),  # fmt: skip
    ("hf_config and path", None, lambda f: [f"model.path={f['model']}"], ["exactly one of model.path"]),
    (
        "truncated weights",
        None,
        lambda f: data(f, "good.jsonl", f"model.path={f['truncated']}"),
        ["model-00003-of-00005.safetensors", "not a readable safetensors file", "re-download"],
    ),  # fmt: skip
    (
        "no SGLang interpreter",
        None,
        lambda f: ["rollout.engine=sglang", "rollout.sglang.python=/nonexistent/bin/python"],
        ["rollout.sglang.python", "/nonexistent/bin/python", "setup_sglang_cpu.sh"],
    ),
    # rewards
    ("reward unknown", None, lambda f: ["reward.name=nosuch"], ["reward.name", "choose one of"]),
    (
        "environment unknown",
        None,
        lambda f: ["rollout.multi_turn.env=nosuch", "rollout.multi_turn.max_total_tokens=64"],
        ["rollout.multi_turn.env", "choose"],
    ),
    (
        "environment refuses its arguments",
        None,
        lambda f: [
            "rollout.multi_turn.env=calculator",
            "rollout.multi_turn.env_kwargs={tools: [rm]}",
            "rollout.multi_turn.max_total_tokens=64",
        ],
        ["rollout.multi_turn.env_kwargs", "unknown calculator tools"],
    ),
    (
        "multi-turn without turns",
        None,
        lambda f: ["rollout.multi_turn.env=calculator", "rollout.multi_turn.max_turns=0"],
        ["rollout.multi_turn.max_turns", ">= 1"],
    ),
    # MoE routing replay
    ("routing replay on a dense model", None, lambda f: ["algorithm.router_replay=R3"], ["router_replay", "dense"]),
    (
        "routing replay with context parallelism",
        None,
        lambda f: ["algorithm.router_replay=R2", "actor.parallel.cp=2"],
        ["actor.parallel.cp", "cp=1"],
    ),
    (
        "R3 with SGLang on CPU",
        None,
        lambda f: ["algorithm.router_replay=R3", "rollout.engine=sglang"],
        ["rollout.engine", "cannot return them", "rollout.engine: cpu"],
    ),
    # fully asynchronous RL
    (
        "a staleness bound below the sync interval",
        None,
        lambda f: [
            "trainer.async_mode=fully_async",
            "trainer.fully_async.sync_every=2",
            "trainer.fully_async.queue_batches=2",
        ],
        ["trainer.fully_async.max_staleness", "sync_every + queue_batches - 1 = 3"],
    ),
    (
        "requests parked across a sync that has none in flight",
        None,
        lambda f: ["trainer.async_mode=one_step_off", "rollout.sync.pause_mode=in_place"],
        ["rollout.sync.pause_mode", "partial_rollout: continue", "pause_mode: auto"],
    ),
    (
        "partial rollouts with a pause that aborts",
        None,
        lambda f: ["trainer.async_mode=fully_async", "rollout.sync.pause_mode=abort"],
        ["rollout.sync.pause_mode", "partial_rollout: continue", "in_place"],
    ),
    (
        "aborted partial rollouts in a multi-turn run",
        None,
        lambda f: [
            "trainer.async_mode=fully_async",
            "trainer.fully_async.partial_rollout=abort",
            "rollout.multi_turn.env=calculator",
        ],
        ["trainer.fully_async.partial_rollout", "multi-turn"],
    ),
    (
        "fully async with colocated turn-taking",
        None,
        lambda f: ["trainer.async_mode=fully_async", "actor.offload=true"],
        ["trainer.async_mode", "offload: false"],
    ),
    ("reward module missing", None, lambda f: ["reward.name=nosuchpkg.mod:fn"], ["reward.name", "nosuchpkg"]),
    ("reward function missing", None, lambda f: ["reward.name=os:nosuchfn"], ["reward.name", "nosuchfn"]),
    ("reward timeout", None, lambda f: ["reward.timeout_s=0"], ["reward.timeout_s"]),
    # engines
    ("engine url refuses", None, lambda f: ["rollout.urls=[http://127.0.0.1:9]"], ["rollout.urls[0]", "127.0.0.1:9"]),
    ("engine url not http", None, lambda f: ["rollout.urls=[127.0.0.1:9]"], ["rollout.urls"]),
]


@pytest.mark.parametrize("case,config,overrides,fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(files, tmp_path, capsys, case, config, overrides, fragments):
    path = CONFIG if config is None else files.get(config, os.path.join(files["root"], config))
    out = tmp_path / "out"
    argv = ["train", path]
    if config is None:  # the case's overrides last: they win over the one-rank layout
        argv += [*ONE_RANK, *overrides(files), f"trainer.output_dir={out}"]
    code = main([*argv, "--no-ray"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error:") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not out.exists(), f"{case} wrote {sorted(os.listdir(out))}"


def _refused(argv, capsys) -> str:
    code = main([*argv, "--no-ray"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error:") and "\n" not in err, err
    return err


def test_an_output_directory_that_cannot_be_written_is_refused_before_anything(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    err = _refused(["train", CONFIG, *ONE_RANK, f"trainer.output_dir={a_file}"], capsys)
    assert "trainer.output_dir" in err and "is a file, not a directory" in err
    err = _refused(["train", CONFIG, *ONE_RANK, f"trainer.output_dir={a_file}/run"], capsys)
    assert "cannot be created" in err and str(a_file) in err
    assert a_file.read_text() == "mine"


def test_an_output_directory_under_a_read_only_one_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root ignores the mode bits
        pytest.skip("running as root: a read-only directory is still writable")
    err = _refused(["train", CONFIG, *ONE_RANK, f"trainer.output_dir={locked}/run"], capsys)
    assert "is not writable" in err and not (locked / "run").exists()


def test_a_cuda_run_on_a_machine_without_cuda_is_refused_before_ray(tmp_path, capsys, monkeypatch):
    """An empty config is the 8-GPU default: here it is refused at once, before Ray starts and before the
    initial model is written into the output directory."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # this machine, whatever the test host has
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    out = tmp_path / "out"
    err = _refused(["train", str(empty), f"trainer.output_dir={out}"], capsys)
    assert "cluster.device" in err and "0 CUDA device(s)" in err and "configs/tiny-cpu-grpo.yaml" in err
    assert not out.exists()
    # a Ray cluster elsewhere may have the GPUs this machine lacks: not refused for that
    from rlsys.config import load_config
    from rlsys.controller.setup import check_machine

    check_machine(load_config(str(empty), [f"trainer.output_dir={out}", "cluster.ray_address=auto"]), True)


def test_the_machine_checks_follow_what_the_mode_starts_here(tmp_path, monkeypatch):
    """--train-only starts no engine (no SGLang interpreter needed); --rollout-only against engines running
    elsewhere trains nothing here (no CUDA device needed)."""
    import torch

    from rlsys.config import load_config
    from rlsys.controller.setup import check_machine
    from rlsys.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = f"trainer.output_dir={tmp_path / 'out'}"
    sglang = load_config(CONFIG, [out, "rollout.engine=sglang", "rollout.sglang.python=/nonexistent/python"])
    check_machine(sglang, False, "train")
    with pytest.raises(ConfigError, match="rollout.sglang.python"):
        check_machine(sglang, False, "full")
    attached = load_config(None, [out, "rollout.urls=[http://10.0.0.1:30000]"])
    check_machine(attached, True, "rollout")
    with pytest.raises(ConfigError, match="0 CUDA device"):
        check_machine(attached, True, "full")
