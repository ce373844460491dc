"""The configuration reference (docs/reference/configuration.md) is generated from the schema by
``tools/config_reference.py``: the committed page must be what the schema generates now, and name every key."""

import dataclasses
import difflib
import typing

import pytest

from rlsys.config import schema
from rlsys.config.schema import RunConfig
from tools import config_reference

PAGE = config_reference.PAGE


def _out_of_date(committed: str, generated: str) -> str:
    diff = difflib.unified_diff(committed.splitlines(), generated.splitlines(), "committed", "generated", lineterm="")
    shown = "\n".join(list(diff)[:30])
    return f"{PAGE.relative_to(PAGE.parents[2])} is out of date: run `{config_reference.COMMAND}`\n{shown}"


def test_the_committed_page_is_what_the_schema_generates():
    committed = PAGE.read_text() if PAGE.exists() else ""
    generated = config_reference.render()
    if committed != generated:  # the command, and the first differences, rather than pytest's diff of two pages
        pytest.fail(_out_of_date(committed, generated), pytrace=False)


def leaf_keys(section, prefix=""):
    """Every dotted key of the config tree, walked here independently of the generator; a mapping of named
    sections (``cluster.pools``) is its own key and then one entry's keys under ``<name>``."""
    hints = typing.get_type_hints(type(section), vars(schema))
    for f in dataclasses.fields(section):
        value, path = getattr(section, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from leaf_keys(value, f"{path}.")
            continue
        yield path
        args = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is dict and dataclasses.is_dataclass(args[1]):
            yield from leaf_keys(args[1](), f"{path}.<name>.")


def test_every_schema_key_has_a_row():
    page = PAGE.read_text()
    keys = list(leaf_keys(RunConfig()))
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"no row for {missing}: run `{config_reference.COMMAND}`"
    assert f"all {len(keys)} keys" in page


def test_a_row_carries_the_comment_the_default_the_rules_and_the_resolution():
    keys = {k.path: k for s in config_reference.annotated() for k in s.keys}
    steps = keys["trainer.steps"]
    assert (steps.type, steps.default, steps.doc) == ("`int`", 100, "RL steps (rollout + update)")
    assert steps.checks == ["must be >= 1"]
    assert keys["critic.enabled"].default is False  # a section's own default (RunConfig.critic), not the class's
    assert keys["critic.optimizer.lr"].default == 1e-5
    # a comment above a run of fields documents each of them
    assert keys["actor.parallel.last_stage_layers"].doc == keys["actor.parallel.first_stage_layers"].doc != ""
    # a rule in a branch the defaults do not take, and a rule on a dict's entries
    assert any("sync_every + queue_batches - 1" in r for r in keys["trainer.fully_async.max_staleness"].checks)
    assert any(r.startswith("`rollout.sglang.env.MASTER_ADDR`") for r in keys["rollout.sglang.env"].checks)
    assert keys["rollout.sync.backend"].decided.startswith("nccl on CUDA")


def test_a_new_field_gets_a_row():
    """What the freshness test catches: a field added to the schema changes the generated page."""

    @dataclasses.dataclass
    class Extra:
        knob: int = 3

    @dataclasses.dataclass
    class Grown(RunConfig):
        extra: Extra = dataclasses.field(default_factory=Extra)

    paths = [k.path for s in config_reference.sections(Grown()) for k in s.keys]
    assert sorted(paths) == sorted([*leaf_keys(RunConfig()), "extra.knob"])
