"""Config loading: every example config, overrides, round trip, and a table of bad configs."""

import dataclasses
import glob
import json
import os

import pytest

from rlsys.config import (
    MOVED_KEYS,
    PolicyObjective,
    RunConfig,
    ValueObjective,
    config_to_dict,
    dump_yaml,
    load_config,
)
from rlsys.errors import ConfigError, UserError
from rlsys.plan import build_plan, model_arch, render_plan
from rlsys.typed_yaml import apply_override

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "*.yaml")))


def _plan(cfg: RunConfig) -> str:
    return render_plan(build_plan(cfg, model_arch(cfg.model)))


def test_there_are_example_configs():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {
        "tiny-cpu-grpo.yaml",
        "qwen2.5-0.5b-gsm8k-grpo.yaml",
        "qwen3-8b-dapo.yaml",
        "qwen3-30b-a3b-grpo.yaml",
        "qwen3-235b-a22b-grpo.yaml",
        "deepseek-v3-671b-grpo.yaml",
        "llama3_8b_ppo.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_example_config_loads_plans_and_renders(path):
    cfg = load_config(path)
    text = _plan(cfg)
    assert "actor:" in text and "memory per rank" in text


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_dump_load_round_trip(path, tmp_path):
    cfg = load_config(path)
    out = tmp_path / "resolved.yaml"
    out.write_text(dump_yaml(cfg))
    assert load_config(str(out)) == cfg


def test_defaults_load_and_plan():
    cfg = load_config(None)
    assert cfg == load_config(None, [])
    assert cfg.algorithm.name == "grpo" and cfg.actor.enabled and cfg.ref.enabled and not cfg.critic.enabled
    assert cfg.critic.optimizer.lr == 1e-5 and cfg.actor.optimizer.lr == 1e-6
    assert cfg.model.hf_config["model_type"] == "qwen2"  # the built-in tiny model when no model is given
    _plan(cfg)


def test_section_defaults_survive_partial_sections(tmp_path):
    # Enabling the critic in YAML keeps its own default lr rather than RoleConfig's.
    path = tmp_path / "c.yaml"
    path.write_text("critic:\n  enabled: true\nalgorithm:\n  name: ppo\n")
    assert load_config(str(path)).critic.optimizer.lr == 1e-5


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        CONFIGS[0],
        [
            "actor.parallel.tp=2",
            "actor.optimizer.lr=3e-6",
            "actor.optimizer.min_lr=0",
            "rollout.sampling.stop=[x, y]",
            "logging.wandb_project=demo",
            "actor.parallel.vpp=null",
            "model.hf_config.rope_theta=5",
        ],
    )
    assert cfg.actor.parallel.tp == 2
    assert cfg.actor.optimizer.lr == 3e-6 and isinstance(cfg.actor.optimizer.min_lr, float)
    assert cfg.rollout.sampling.stop == ["x", "y"]
    assert cfg.logging.wandb_project == "demo"
    assert cfg.model.hf_config["rope_theta"] == 5


def test_yaml12_scalars(tmp_path):
    # PyYAML would read 1e-6 as a string and `yes` as true; the config loader uses YAML 1.2 rules.
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  optimizer:\n    lr: 1e-6\nrollout:\n  sampling:\n    stop: [no, off]\n")
    cfg = load_config(str(path))
    assert cfg.actor.optimizer.lr == 1e-6 and cfg.rollout.sampling.stop == ["no", "off"]


def test_config_to_dict_mirrors_yaml_sections():
    d = config_to_dict(load_config(None))
    assert list(d) == [
        "model",
        "actor",
        "critic",
        "ref",
        "rollout",
        "algorithm",
        "data",
        "reward",
        "trainer",
        "cluster",
        "logging",
    ]
    assert d["actor"]["parallel"]["tp"] == 1


def test_missing_file_and_bad_yaml_name_the_file(tmp_path):
    with pytest.raises(UserError, match="nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(UserError, match="bad.yaml.*not valid YAML"):
        load_config(str(bad))


TINY_MOE = "model.hf_config=" + json.dumps(
    dict(
        model_type="qwen3_moe",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        hidden_act="silu",
    )
)
CPU = ["cluster.device=cpu", "rollout.engine=cpu"]

# (case, overrides on the defaults: tiny qwen2 with 4 heads, 2 KV heads, 4 layers; 1 node x 8 GPUs, fragment)
BAD = [
    ("unknown key", ["actor.paralel.tp=2"], "actor.paralel': unknown key 'paralel' in actor; did you mean 'parallel'"),
    ("unknown section", ["rolout.tp=2"], "did you mean 'rollout'"),
    ("key under a value", ["model.dtype.x=1"], "'model.dtype' is a value, not a section"),
    ("malformed override", ["actor.parallel.tp"], "must look like key.path=value"),
    ("wrong type int", ["actor.parallel.tp='2'"], "actor.parallel.tp': expected int, got '2'"),
    ("wrong type float", ["actor.optimizer.lr=fast"], "actor.optimizer.lr': expected float, got 'fast'"),
    ("bool is not yes", ["trainer.resume=yes"], "trainer.resume': expected bool, got 'yes'"),
    ("bool is not int", ["actor.parallel.tp=true"], "expected int, got True"),
    ("section not mapping", ["actor.parallel=3"], "actor.parallel': expected a mapping"),
    ("list item type", ["rollout.sampling.stop=[1]"], "rollout.sampling.stop[0]': expected str"),
    ("bad enum", ["algorithm.name=grpoo"], "'grpoo' is not allowed; expected one of 'grpo', 'ppo'"),
    ("bad dtype", ["model.dtype=float16"], "model.dtype"),
    ("negative lr", ["actor.optimizer.lr=-1"], "actor.optimizer.lr': -1.0 is invalid: must be >= 0"),
    ("negative clip", ["algorithm.loss.clip_low=-0.1"], "algorithm.loss.clip_low': -0.1 is invalid"),
    ("zero tp", ["actor.parallel.tp=0"], "actor.parallel.tp': 0 is invalid: must be >= 1"),
    ("actor off", ["actor.enabled=false"], "the actor is always on"),
    ("ppo without critic", ["algorithm.name=ppo"], "needs a critic"),
    (
        "sgd sharded",
        ["actor.optimizer.name=sgd"],
        "only supports adam; set actor.optimizer.use_distributed_optimizer=false",
    ),
    (
        "sp on cpu",
        ["cluster.device=cpu", "rollout.engine=cpu", "actor.parallel.sequence_parallel=true"],
        "needs transformer-engine",
    ),
    ("mismatch mode", ["algorithm.mismatch.mode=is"], "algorithm.mismatch.mode"),
    (
        "mis lower with tis",
        ["algorithm.mismatch.mode=tis", "algorithm.mismatch.lower=0.5"],
        "only applies to mode 'mis'",
    ),
    (
        "overlong buffer",
        ["algorithm.filters.overlong.enabled=true", "algorithm.filters.overlong.buffer_length=99999"],
        "max_new_tokens",
    ),
    (
        "dynamic rounds",
        ["algorithm.filters.dynamic_sampling.max_rounds=0"],
        "algorithm.filters.dynamic_sampling.max_rounds",
    ),
    ("critic warmup without critic", ["algorithm.schedule.critic_warmup_steps=2"], "needs critic.enabled: true"),
    ("value clip", ["algorithm.value_loss.clip=0"], "algorithm.value_loss.clip': 0.0 is invalid"),
    ("mini batches vs samples", ["algorithm.schedule.mini_batches_per_step=7"], "must divide the samples per step"),
    ("grpo with n=1", ["rollout.sampling.n=1"], "needs n >= 2"),
    ("kl without ref", ["ref.enabled=false"], "algorithm.kl.coef > 0 needs the reference model"),
    ("broadcast into a colocated gpu engine", ["rollout.sync.transport=broadcast"], "NCCL refuses a group with two"),
    ("tensor to attached engines", ["rollout.sync.transport=tensor", "rollout.urls=[http://h:1]"], "rollout.urls"),
    (
        "tensor transport, not colocated",
        ["rollout.sync.transport=tensor", "cluster.colocate=false", "actor.world_size=4"],
        "needs every engine colocated",
    ),
    ("world not divisible", ["actor.world_size=6", "actor.parallel.pp=4"], "6 is not divisible by tp*pp*cp"),
    ("heads vs tp", ["actor.parallel.tp=8"], "does not divide num_attention_heads=4"),
    ("kv heads vs tp", ["actor.parallel.tp=4"], "num_key_value_heads=2. Megatron-core 0.16"),
    ("kv heads suggestion", ["ref.parallel.tp=4"], "use tp in [1, 2]"),
    ("layers vs pp", ["actor.world_size=3", "actor.parallel.pp=3"], "3 does not divide num_layers=4"),
    ("layers vs pp*vpp", ["actor.parallel.pp=2", "actor.parallel.vpp=4"], "not divisible by pp*vpp = 8"),
    ("vpp without pp", ["actor.parallel.vpp=2"], "virtual pipeline stages need pp > 1"),
    (
        "uneven stages",
        ["actor.parallel.pp=2", "actor.parallel.first_stage_layers=3", "actor.parallel.last_stage_layers=2"],
        "does not split evenly",
    ),
    ("sp without tp", ["actor.parallel.sequence_parallel=true"], "sequence parallelism needs tp > 1"),
    ("cp on cpu", [*CPU, "actor.parallel.cp=2"], "context parallelism needs cluster.device 'cuda'"),
    ("ep on dense", ["actor.parallel.ep=2"], "is a dense model"),
    ("experts vs ep", [TINY_MOE, "actor.parallel.ep=4"], "4 does not divide num_experts=6"),
    (
        "moe world vs etp*ep*pp",
        [
            TINY_MOE,
            "actor.world_size=6",
            "actor.parallel.ep=6",
            "actor.parallel.pp=2",
            "data.prompts_per_step=6",
            "rollout.sampling.n=2",
        ],
        "not divisible by etp*ep*pp",
    ),
    (
        "moe ffn vs etp",
        [
            TINY_MOE,
            "actor.parallel.tp=2",
            "actor.parallel.etp=16",
            "actor.world_size=16",
            "cluster.devices_per_node=16",
        ],
        "does not divide moe_intermediate_size=24",
    ),
    ("rollout tp vs heads", ["rollout.tp=8"], "rollout.tp': 8 does not divide num_attention_heads=4"),
    (
        "rollout tp vs devices",
        ["cluster.devices_per_node=6", "rollout.tp=4", "data.prompts_per_step=6"],
        "does not divide the cluster's 6 devices",
    ),
    ("too many devices", ["actor.world_size=16"], "more devices than cluster.nodes * cluster.devices_per_node = 8"),
    ("too many engines", ["rollout.num_engines=9"], "need 9 devices"),
    (
        "disaggregated overflow",
        ["cluster.colocate=false", "actor.world_size=8", "rollout.num_engines=2"],
        "need actor 8 + critic 0 + rollout 2 = 10 devices",
    ),
    (
        "disaggregated critic size",
        ["cluster.colocate=false", "algorithm.name=ppo", "critic.enabled=true"],
        "critic.world_size': None is invalid",
    ),
    ("batch vs dp", ["data.prompts_per_step=3", "rollout.sampling.n=2"], "6 samples"),
    ("min above max", ["rollout.sampling.min_new_tokens=9999"], "must be in [0, rollout.sampling.max_new_tokens="),
    ("sequence too long", ["rollout.sampling.max_new_tokens=4000"], "exceeds the model's max_position_embeddings"),
    ("token budget below a sequence", ["actor.batch.max_tokens_per_microbatch=100"], "must hold one whole sequence"),
    (
        "missing checkpoint",
        ["model.path=/does/not/exist"],
        "model.path': checkpoint directory '/does/not/exist' does not exist",
    ),
]


@pytest.mark.parametrize("case,overrides,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_config(case, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        _plan(load_config(None, overrides))
    assert fragment in str(err.value)


def test_bad_key_in_yaml_file_has_full_path_and_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  optimizer:\n    learning_rate: 1.0e-6\n")
    with pytest.raises(ConfigError, match=r"actor.optimizer.learning_rate'.*valid keys: name, lr"):
        load_config(str(path))
    path.write_text("actor:\n  paralel:\n    tp: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'parallel'"):
        load_config(str(path))


def test_path_and_hf_config_are_exclusive(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: /some/ckpt\n  hf_config: {model_type: qwen2}\n")
    with pytest.raises(ConfigError, match="exactly one of model.path and model.hf_config"):
        load_config(str(path))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_example_config_uses_current_keys(path):
    # without the planner (test_example_config_loads_plans_and_renders): load_config refuses moved keys
    assert isinstance(load_config(path).algorithm.loss.clip_low, float)


@pytest.mark.parametrize(
    "old,new",
    [
        ("algorithm.clip_low=0.1", "algorithm.loss.clip_low"),
        ("algorithm.kl_coef=0", "algorithm.kl.coef"),
        ("algorithm.loss_agg_mode=token-mean", "algorithm.loss.agg_mode"),
        ("algorithm.norm_adv_by_std=false", "algorithm.advantage.norm_by_std"),
        ("algorithm.value_clip=null", "algorithm.value_loss.clip"),
        ("algorithm.mini_batches_per_step=2", "algorithm.schedule.mini_batches_per_step"),
        ("algorithm.dynamic_sampling.enabled=true", "algorithm.filters.dynamic_sampling.enabled"),
        ("algorithm.overlong={enabled: true}", "algorithm.filters.overlong"),
    ],
)
def test_moved_key_as_override_names_the_new_key(old, new):
    key = old.partition("=")[0]
    with pytest.raises(ConfigError, match=f"{key} moved to {new}; rename it in your config") as err:
        load_config(None, [old])
    assert err.value.path == key


def test_moved_keys_in_yaml_file_name_the_new_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  name: grpo\n  clip_low: 0.2\n  kl_coef: 0.0\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    # every moved key of the section at once, so an old config is fixed in one pass
    assert str(err.value).endswith(
        "algorithm.clip_low moved to algorithm.loss.clip_low, algorithm.kl_coef moved to algorithm.kl.coef; "
        "rename them in your config"
    )
    path.write_text("algorithm:\n  dynamic_sampling:\n    enabled: true\n")
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling moved to algorithm.filters.dynamic_sampling"):
        load_config(str(path))


def test_moved_table_points_at_existing_keys():
    # a stale MOVED_KEYS entry would send people to a key that is refused too
    for old, new in MOVED_KEYS.items():
        with pytest.raises(ConfigError, match="moved to"):
            apply_override({}, f"{old}=1", RunConfig, MOVED_KEYS)
        apply_override({}, f"{new}=1", RunConfig, MOVED_KEYS)


def test_objectives_carry_only_their_sections():
    a = load_config(None, ["algorithm.loss.clip_high=0.3", "algorithm.value_loss.clip=0.4"]).algorithm
    policy, value = PolicyObjective.of(a), ValueObjective.of(a)
    assert [f.name for f in dataclasses.fields(policy)] == ["name", "loss", "kl", "schedule", "router_replay"]
    assert [f.name for f in dataclasses.fields(value)] == ["loss", "schedule"]
    assert policy.loss.clip_high == 0.3 and value.loss.clip == 0.4 and policy.schedule == value.schedule
