"""A deterministic toy search tool over a small local corpus (``rollout.multi_turn.env: search``).

``search(query)`` ranks the corpus's passages by BM25 over lower-cased words and returns the best
``top_k``, numbered. The corpus is a JSONL file of ``{"title", "text"}`` records (``env_kwargs.corpus``),
or, by default, a built-in one about fictional towns, so no model can know the answers without searching.
``python -m rlsys.envs.search --out FILE --n N`` writes questions about it (``{"prompt", "answer"}``) for
the ``exact_match`` or ``math`` rewards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
from collections import Counter

from rlsys.envs.base import ToolEnvironment, tool_schema

_WORD = re.compile(r"[a-z0-9]+")
_PARTS = ("Elm", "Ash", "Oak", "Birch", "Wil", "Hol", "Fen", "Mar", "Tor", "Brack", "Quill", "Dun")
_ENDS = ("worth", "ford", "by", "wick", "stead", "mere", "ton", "holt")
_PEOPLE = ("Ada Renn", "Tomas Vell", "Ines Korr", "Ravi Sohl", "Mila Dorn", "Owen Pike", "Lia Brandt", "Jon Ekk")
_RIVERS = ("Sarn", "Ulla", "Vey", "Orme", "Tessel", "Kell")


def builtin_corpus(seed: int = 0) -> list[dict]:
    """One passage per fictional town: its founder, founding year, river and population."""
    rng = random.Random(seed)
    names = [a + b for a in _PARTS for b in _ENDS]
    rng.shuffle(names)
    corpus = []
    for name in names[:60]:
        founder, river = rng.choice(_PEOPLE), rng.choice(_RIVERS)
        year, people = rng.randint(1400, 1900), rng.randint(2, 90) * 100
        text = f"{name} was founded by {founder} in {year}. It lies on the river {river} and has {people} inhabitants."
        corpus.append({"title": name, "text": text, "year": year, "founder": founder, "river": river})
    return corpus


def questions(n: int, seed: int = 0, corpus_seed: int = 0) -> list[dict]:
    rng, corpus = random.Random(seed), builtin_corpus(corpus_seed)
    asks = (
        ("In which year was {t} founded?", "year"),
        ("Who founded {t}?", "founder"),
        ("On which river does {t} lie?", "river"),
    )
    out = []
    for _ in range(n):
        doc, (question, key) = rng.choice(corpus), rng.choice(asks)
        out.append({"prompt": question.format(t=doc["title"]), "answer": str(doc[key])})
    return out


class Index:
    """BM25 over the passages' words (k1 1.5, b 0.75)."""

    def __init__(self, docs: list[dict]):
        self.docs = docs
        self.terms = [Counter(_WORD.findall(f"{d.get('title', '')} {d['text']}".lower())) for d in docs]
        self.avg = sum(sum(t.values()) for t in self.terms) / max(len(docs), 1)
        df = Counter(w for t in self.terms for w in t)
        self.idf = {w: math.log(1 + (len(docs) - f + 0.5) / (f + 0.5)) for w, f in df.items()}

    def search(self, query: str, top_k: int) -> list[dict]:
        words = _WORD.findall(query.lower())
        scores = []
        for i, t in enumerate(self.terms):
            length = sum(t.values())
            s = sum(
                self.idf[w] * t[w] * 2.5 / (t[w] + 1.5 * (0.25 + 0.75 * length / self.avg)) for w in words if w in t
            )
            scores.append((-s, i))
        return [self.docs[i] for s, i in sorted(scores)[:top_k] if s < 0]


_INDEXES: dict = {}  # one per corpus, shared by every trajectory's environment


class SearchEnv(ToolEnvironment):
    def __init__(self, corpus: str | None = None, top_k: int = 2, call_reward: float = 0.0):
        if corpus not in _INDEXES:
            docs = builtin_corpus() if corpus is None else _read_corpus(corpus)
            _INDEXES[corpus] = Index(docs)
        self.index, self.top_k, self.call_reward = _INDEXES[corpus], top_k, float(call_reward)
        self.functions = {"search": self.search}
        self.tools = [tool_schema("search", "Search the encyclopedia; returns the best passages.", {"query": "words"})]

    def search(self, query: str) -> str:
        hits = self.index.search(str(query), self.top_k)
        if not hits:
            return "no results"
        return "\n".join(f"[{i + 1}] {d.get('title', '')}: {d['text']}" for i, d in enumerate(hits))


def _read_corpus(path: str) -> list[dict]:
    docs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); the corpus is JSONL of title/text") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise ValueError(f'{path}:{n}: a corpus record needs a "text" string')
            docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: the corpus is empty")
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        for q in questions(args.n, args.seed):
            f.write(json.dumps(q) + "\n")
    os.replace(tmp, args.out)  # a finished file or none
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
