"""The configuration reference page, generated from the schema so that it cannot drift from it.

    python -m tools.config_reference            # writes docs/reference/configuration.md
    python -m tools.config_reference --check    # exit 1 when the committed page is out of date

Every key of ``rlsys.config.schema.RunConfig`` (dotted path) with its type, its default, the comment that documents
it in ``schema.py``, the field rules of ``rlsys.config.rules`` that check it and what ``rlsys.config.resolve``
decides for it. ``tests/unit/test_config_reference.py`` fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from pathlib import Path

from rlsys.config import rules, schema

# rlsys.config re-exports the function resolve under the module's name
resolve = importlib.import_module("rlsys.config.resolve")

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
COMMAND = "python -m tools.config_reference"


# ------------------------------------------------------------ what schema.py says about each field


def field_comments(module) -> dict[str, dict[str, str]]:
    """``{class name: {field: comment}}``: the ``#`` comment above a field and the one on its line(s). A comment
    block above a run of uncommented fields documents all of them (``first_stage_layers``, ``last_stage_layers``)."""
    source = inspect.getsource(module)
    comments = {}  # line -> text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        text = tok.string.lstrip("#").strip()
        if tok.type == tokenize.COMMENT and not text.startswith(("fmt:", "noqa")):
            comments[tok.start[0]] = text
    lines = source.splitlines()
    out = {}
    for cls in (n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)):
        docs, shared = {}, ""
        for node in cls.body:
            if not isinstance(node, ast.AnnAssign):
                shared = ""
                continue
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#") and line in comments:
                above.insert(0, comments[line])
                line -= 1
            trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            docs[node.target.id] = " ".join(above + trailing) or shared
            if above or trailing:  # a field with its own comment starts a group, or ends one
                shared = " ".join(above)
        out[cls.name] = docs
    return out


def class_docs(module) -> dict[str, str]:
    """Each class's own docstring (from the source: a dataclass without one gets its signature as ``__doc__``)."""
    tree = ast.parse(inspect.getsource(module))
    return {n.name: ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.ClassDef)}


# ------------------------------------------------------------ the keys


@dataclasses.dataclass
class Key:
    path: str
    type: str
    default: object
    doc: str
    checks: list[str] = dataclasses.field(default_factory=list)
    decided: str = ""


@dataclasses.dataclass
class Section:
    path: str  # "" for the top level
    doc: str
    keys: list[Key]


def sections(cfg=None) -> list[Section]:
    """The config tree in field order: one section per dataclass (nested ones after their parent's keys). Defaults
    are read from an instance, so a section's own defaults (``critic``'s ``enabled: false``) show."""
    cfg = cfg if cfg is not None else schema.RunConfig()
    comments, docs, out = field_comments(schema), class_docs(schema), []

    def walk(obj, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj), vars(schema))
        section = Section(prefix, docs.get(type(obj).__name__, ""), [])
        out.append(section)
        nested = []
        for f in dataclasses.fields(obj):
            path, value = f"{prefix}.{f.name}" if prefix else f.name, getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((value, path))
                continue
            args = typing.get_args(hints[f.name])
            if typing.get_origin(hints[f.name]) is dict and dataclasses.is_dataclass(args[1]):
                nested.append((args[1](), f"{path}.<name>"))  # named sections (cluster.pools): one entry's keys
            doc = comments.get(type(obj).__name__, {}).get(f.name, "")
            section.keys.append(Key(path, type_name(hints[f.name]), value, doc))
        for value, path in nested:
            walk(value, path)

    walk(cfg, "")
    return [s for s in out if s.keys]


def type_name(tp) -> str:
    """A type as a YAML user reads it: ``int``, ``float or null``, one of ``a``, ``b``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in rest) + " or `null`"
    if typing.get_origin(tp) in (list, dict):
        return f"`{getattr(tp, '__name__', 'x')}[{', '.join(_bare(a) for a in args)}]`"
    return f"`{_bare(tp)}`"


def _bare(tp) -> str:
    return "Any" if tp is typing.Any else getattr(tp, "__name__", str(tp))


def yaml_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value and value.strip() == value and value[0] not in "{[*&!|>'\"%@`" else repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value)


# ------------------------------------------------------------ what checks and decides each key


def field_rules() -> dict[str, dict[tuple, str]]:
    """``{key: {rule's call site: rule}}`` from ``rules.check_fields``, recorded rather than parsed: every
    ``_need`` it calls (passing or not) names the key and the rule. It runs on the defaults and on a config that
    takes every conditional branch (fully async, multi-turn, routing replay, a critic, delta sync...), with
    ``_need`` made to record instead of raise, so that each rule is reached whatever the values."""
    found: dict[str, dict[tuple, str]] = {}

    def record(ok, path, value, rule):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "_positive":  # one site, many keys: the caller's caller tells them apart
            caller = caller.f_back
        found.setdefault(path, {}).setdefault((caller.f_code.co_name, caller.f_lineno), rule)

    original = rules._need
    rules._need = record
    try:
        for cfg in _scenarios():
            rules.check_fields(cfg)
    finally:
        rules._need = original
    return found


def _scenarios() -> list[schema.RunConfig]:
    default = schema.RunConfig()
    default.model.hf_config = copy.deepcopy(schema.TINY_HF_CONFIG)  # as load_config fills it in
    branches = copy.deepcopy(default)
    branches.algorithm.name = "ppo"  # an estimator that needs values (the defaults cover one that needs groups)
    branches.algorithm.router_replay = "R3"
    branches.algorithm.schedule.critic_warmup_steps = 1
    branches.algorithm.filters.overlong.enabled = True
    branches.trainer.async_mode = "fully_async"
    branches.rollout.release_memory = True
    branches.rollout.sync.delta = True
    branches.rollout.sync.shards = "parts"
    branches.rollout.sglang.env = {"MASTER_ADDR": "", "MASTER_PORT": ""}
    branches.rollout.multi_turn.env = "calculator"
    branches.rollout.multi_turn.agent = "agents:solve"
    branches.cluster.pools = {"<name>": schema.PoolConfig()}  # its rules, under the reference's key names
    return [default, branches]


def resolved_from() -> dict[str, str]:
    """``{key: what decides it}`` from the table in ``rlsys.config.resolve``'s docstring, for ``RESOLVED_KEYS``."""
    rows = dict(re.findall(r"^``([\w.]+)``\s{2,}(.+)$", resolve.__doc__ or "", re.MULTILINE))
    return {key: rows.get(key, f"see `rlsys.config.resolve` ({key})") for key in resolve.RESOLVED_KEYS}


def annotated() -> list[Section]:
    out = sections()
    keys = {k.path: k for s in out for k in s.keys}
    by_key: dict[str, dict[tuple, tuple[list[str], str]]] = {}  # key -> rule's site -> (paths it names, rule)
    for path, by_site in field_rules().items():
        owner = _owner(path, keys)
        for site, rule in by_site.items():
            by_key.setdefault(owner.path, {}).setdefault(site, ([], rule))[0].append(path)
    for name, found in by_key.items():  # a rule on a dict's entries names them: `a.X`, `a.Y`: rule
        keys[name].checks = [r if p == [name] else ", ".join(f"`{x}`" for x in p) + f": {r}" for p, r in found.values()]
    for path, text in resolved_from().items():
        keys[path].decided = text
    return out


def _owner(path: str, keys: dict[str, Key]) -> Key:
    """The key a rule's path names, or the key it lies under (``rollout.sglang.env.MASTER_ADDR``)."""
    name = path
    while name and name not in keys:
        name = name.rpartition(".")[0]
    if not name:  # a rule on a whole section: the page has no row for it, so say so rather than drop it
        raise ValueError(f"rlsys.config.rules names {path!r}, which is no key of the schema")
    return keys[name]


# ------------------------------------------------------------ the page


def render() -> str:
    out = annotated()
    count = sum(len(s.keys) for s in out)
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from rlsys/config/schema.py, rules.py and resolve.py: do not edit. -->",
        "",
        "A run's config is one YAML file whose sections mirror the dataclass tree of `rlsys.config.schema.RunConfig`",
        "key for key; `key.path=value` arguments after the file override single keys, with the same type checks.",
        f"An unknown, misspelled or moved key is an error naming it. This page lists all {count} keys.",
        "",
        "- **Checked**: the field rules of `rlsys/config/rules.py` (`check_fields`, run by `load_config` before",
        "  anything starts), with the numbers they show for the default config. Rules that need the model or the",
        "  cluster (heads against `tp`, layers against `pp`, the memory of each phase) are in `rlsys/plan/checks.py`",
        "  and run in `rlsys plan` and before `rlsys train` starts anything.",
        "- **Decided**: keys whose `auto` (or `null`) `rlsys/config/resolve.py` decides once, after validation; a",
        "  run keeps the decided config as `OUTPUT/resolved.yaml`.",
        "",
    ]
    for section in out:
        lines += _section(section)
    lines += ["## Moved keys", "", "A config that uses an old key is refused with the new one named.", ""]
    lines += ["| old key | new key |", "| --- | --- |"]
    lines += [f"| `{old}` | `{new}` |" for old, new in schema.MOVED_KEYS.items()]
    return "\n".join(lines) + "\n"


def _section(section: Section) -> list[str]:
    lines = [f"## `{section.path}`" if section.path else "## Top level", ""]
    if section.doc:
        lines += [_text(" ".join(section.doc.split())), ""]
    lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key in section.keys:
        cell = [_text(key.doc)] if key.doc else []
        cell += [f"**Checked**: {_text(rule)}" for rule in key.checks]
        cell += [f"**Decided**: {_text(key.decided)}"] if key.decided else []
        default = yaml_value(key.default).replace("|", "\\|")
        lines.append(f"| `{key.path}` | {key.type} | `{default}` | {'<br>'.join(cell)} |")
    return lines + [""]


def _text(text: str) -> str:
    """Markdown for a comment inside a table cell: code spans (``x`` or `x`) kept, `*`, `<`, `>`, `|` escaped
    outside them."""
    parts = re.split(r"(``.+?``|`[^`]+`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is out of date")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(PAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
