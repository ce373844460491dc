"""The package's shape, as rules a change must keep: no import cycles, modules and functions a reader can
take in at once, rank-side code that never reaches for the controller.

Imports are read from the source (``ast``), function-level ones included: a cycle hidden inside a
function still makes two modules impossible to read or test apart. Imports under ``if TYPE_CHECKING:``
are left out; they exist for annotations only and never run.
"""

import ast
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[2] / "rlsys"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def _imports(name: str, path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.startswith("rlsys"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("rlsys"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    found.add(full if full in MODULES else _resolve(base))
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str:
    """A module's (sub)package: ``rlsys.rollout.cpu.server`` -> ``rlsys.rollout.cpu``; top-level modules
    are their own unit."""
    if MODULES[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return parent if parent != "rlsys" else module


def test_no_import_cycle_between_modules():
    assert _cycles(GRAPH) == []


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        graph.setdefault(_package(module), set()).update(_package(d) for d in deps if _package(d) != _package(module))
    assert _cycles(graph) == []


def test_rank_side_code_never_imports_the_controller():
    rank_side = ("rlsys.worker", "rlsys.megatron", "rlsys.sync", "rlsys.algorithms", "rlsys.architectures")
    offenders = {
        m: sorted(d for d in deps if d.startswith("rlsys.controller"))
        for m, deps in GRAPH.items()
        if m.startswith(rank_side)
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_architecture_tables_and_hf_io_do_not_import_megatron():
    """The tables are data about HF and Megatron names; tools read them without building a model."""
    offenders = {
        m: sorted(d for d in deps if d.startswith(("rlsys.megatron", "rlsys.convert")))
        for m, deps in GRAPH.items()
        if m.startswith("rlsys.architectures")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_modules_and_functions_fit_one_sitting():
    """A function may be longer when its docstring says why ("long because ..."). The benchmarks too: they are
    read to trust their numbers."""
    benchmarks = {f"benchmarks.{p.stem}": p for p in (ROOT.parent / "benchmarks").glob("*.py")}
    too_long = []
    for name, path in {**MODULES, **benchmarks}.items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                reason = "long because" in (ast.get_docstring(node) or "").lower()
                if lines > MAX_FUNCTION_LINES and not reason:
                    too_long.append(f"{name}.{node.name}: {lines} lines")
    assert too_long == []


def test_the_loop_file_stays_short():
    assert (ROOT / "controller" / "loop.py").read_text().count("\n") < 200


def test_no_utils_module_and_no_stdlib_shadowing():
    import sys

    names = {p.stem for p in ROOT.rglob("*.py")} | {p.name for p in ROOT.rglob("*") if p.is_dir()}
    assert not names & {"utils", "util", "helpers", "misc"}
    top = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or p.is_dir()}
    assert not top & set(sys.stdlib_module_names)


MAX_PUBLIC_METHODS = 12
# Classes that mirror an HTTP API, one method per endpoint; their callers hold them through narrower Protocols.
WIRE_APIS = {
    "EngineClient": "SGLang's HTTP API; callers see rlsys.rollout.engine's Generation, EngineControl, WeightReceiver",
    "CPUEngine": "the server side of the same API, one handler per endpoint",
}


def _classes() -> dict[str, tuple[str, list[str], list[str]]]:
    found = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                own = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                found[node.name] = (name, [m for m in own if not m.startswith("_")], bases)
    return found


def test_classes_keep_a_small_public_interface():
    """Public methods, inherited ones from rlsys's own bases included: a class whose interface outgrows a reader is
    several concepts (split by who calls what, as ``rlsys.rollout.engine``'s Protocols split the engine API)."""
    classes = _classes()

    def public(cls: str, seen: tuple = ()) -> set[str]:
        if cls not in classes or cls in seen:
            return set()
        _, own, bases = classes[cls]
        return set(own).union(*(public(b, (*seen, cls)) for b in bases))

    large = {f"{classes[c][0]}.{c}": len(public(c)) for c in classes if c not in WIRE_APIS}
    assert {c: n for c, n in large.items() if n > MAX_PUBLIC_METHODS} == {}


def test_no_module_asks_which_engine_runs():
    """What an engine can do is declared once (``rlsys.config.engines``); a comparison of ``...engine`` with a name
    is a branch a new engine would have to find."""
    asks = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = any(isinstance(s, ast.Attribute) and s.attr == "engine" for s in sides)
                names = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
                if named and any(n != "auto" for n in names):  # auto is no engine: resolve decides it
                    asks.append(f"{name}:{node.lineno}")
    assert asks == []


# Where an ``auto`` is still decided at run time, and from what only exists then (rlsys.config.resolve says so too).
DECIDED_AT_RUN_TIME = {
    "rlsys.sync.distributed": "sync.shards: the engines' answer at connect; weight_dtype 'auto' is the served dtype",
    "rlsys.telemetry.progress": "logging.progress: whether the stream it writes to is a terminal",
    "rlsys.envs.tool_calls": "the multi-turn tool format: the tokenizer's chat template",
    "rlsys.rewards.manager": "reward.executor: the reward function's own declaration",
    "rlsys.rollout.cpu.server": "the CPU engine server's own --dtype flag, not a config key",
}
DECIDES = {"rlsys.config.resolve", "rlsys.config.rules"}  # the resolve step, and the rules that check its inputs


def _names_auto(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value == "auto"
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_auto(e) for e in node.elts)


def test_no_auto_is_read_outside_the_resolve_step():
    """Every ``auto`` of the config is decided once (``rlsys.config.resolve``), so what a run uses is printed by
    ``rlsys plan`` and kept in ``resolved.yaml``; components receive decided values."""
    reads = []
    for name, path in MODULES.items():
        if name in DECIDES or name in DECIDED_AT_RUN_TIME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(_names_auto(s) for s in [node.left, *node.comparators]):
                reads.append(f"{name}:{node.lineno}")
    assert reads == []


def test_every_field_of_run_is_a_declared_seam_or_a_class():
    """What ``loop.step`` calls on is named by its type: a Protocol (``rlsys.controller.seams``) or one concrete
    class, never a union to dispatch on with ``isinstance`` nor ``Any``."""
    import dataclasses
    import typing

    from rlsys.controller.run import Run
    from rlsys.telemetry.metrics import MetricsLogger  # imported for type checking only there
    from rlsys.telemetry.progress import ProgressReporter

    hints = typing.get_type_hints(Run, localns={"MetricsLogger": MetricsLogger, "ProgressReporter": ProgressReporter})
    loose = {}
    for f in dataclasses.fields(Run):
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            if len(args) > 1:  # optional is fine: one type or nothing
                loose[f.name] = hint
            continue
        if hint is typing.Any or (origin is None and not isinstance(hint, type)):
            loose[f.name] = hint
    assert loose == {}
