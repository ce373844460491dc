"""Where a test run's time went, from the JUnit XML that ``make test`` writes (test-results/junit.xml).

    python tools/test_report.py [test-results/junit.xml] [--slowest N] [--over S]

Prints seconds and test counts per folder (unit, dist, e2e, sglang, ...) and per file, the N slowest tests, and,
with ``--over``, which tests over S seconds lack the ``slow`` marker (``make test-fast`` runs those).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def cases(path: str) -> list[dict]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")  # tests.dist.test_convert (a class adds a part)
        parts = module.split(".")
        folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else "(top)"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        out.append(
            dict(file="/".join(parts[:3]) + ".py", folder=folder, name=case.get("name"), outcome=outcome,
                 seconds=float(case.get("time") or 0.0))
        )  # fmt: skip
    return out


def table(rows: list[dict], key: str) -> list[tuple[str, int, float]]:
    seconds, counts = collections.Counter(), collections.Counter()
    for r in rows:
        seconds[r[key]] += r["seconds"]
        counts[r[key]] += 1
    return [(k, counts[k], seconds[k]) for k, _ in seconds.most_common()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", nargs="?", default="test-results/junit.xml")
    ap.add_argument("--slowest", type=int, default=30)
    ap.add_argument("--files", type=int, default=25, help="how many files to list")
    args = ap.parse_args(argv)
    rows = cases(args.junit)
    total = sum(r["seconds"] for r in rows)
    outcomes = collections.Counter(r["outcome"] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} s of test time; " + ", ".join(f"{n} {k}" for k, n in outcomes.items()))
    print("\n| folder | tests | seconds | share |\n| --- | --- | --- | --- |")
    for name, n, s in table(rows, "folder"):
        print(f"| {name} | {n} | {s:.0f} | {s / max(total, 1e-9):.0%} |")
    print(f"\n{args.files} files with the most time:")
    for name, n, s in table(rows, "file")[: args.files]:
        print(f"{s:8.1f} s {n:4d} tests  {name}")
    print(f"\n{args.slowest} slowest tests:")
    for r in sorted(rows, key=lambda r: -r["seconds"])[: args.slowest]:
        print(f"{r['seconds']:8.1f} s  {r['file']}::{r['name']} ({r['outcome']})")


if __name__ == "__main__":
    main()
