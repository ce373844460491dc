"""Writing a generated task's splits as JSONL, one command line per task (``python -m rlsys.data.arithmetic``,
``python -m rlsys.data.counting``): ``--out FILE --n N --seed S [--exclude OTHER.jsonl]``, where ``--exclude`` leaves
out every prompt of another file, so that a held-out split is disjoint from the training one."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable

Generate = Callable[[int, int, Iterable[str]], list[dict]]  # (n, seed, prompts to leave out) -> records


def write_jsonl(records: list[dict], path: str) -> None:
    """Write atomically (a reader never sees half a file), creating parent directories."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_prompts(path: str) -> set[str]:
    with open(path) as f:
        return {json.loads(line)["prompt"] for line in f if line.strip()}


def main(generate: Generate, prog: str, description: str, noun: str, argv: list[str] | None = None) -> int:
    """The task's command line: ``generate`` ``--n`` records of ``--seed`` into ``--out``."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--out", required=True, help="output JSONL file")
    ap.add_argument("--n", type=int, required=True, help=f"number of {noun}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude", action="append", default=[], help=f"JSONL file whose {noun} to leave out")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be at least 1")
    exclude = set().union(*(read_prompts(p) for p in args.exclude))
    write_jsonl(generate(args.n, args.seed, exclude), args.out)
    print(f"wrote {args.n} {noun} to {args.out}")
    return 0
