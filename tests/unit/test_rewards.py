"""Reward functions, the registry, the code sandbox, the remote client and the manager's failure handling."""

import json
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from rlsys.errors import UserError
from rlsys.rewards import RewardManager, available_rewards, get_reward_fn, get_reward_spec
from rlsys.rewards.basic import exact_match, format_reward
from rlsys.rewards.code import code_reward, extract_code, run_program
from rlsys.rewards.gsm8k import extract_final_number, gsm8k_reward
from rlsys.rewards.math import last_boxed
from rlsys.rewards.remote import RemoteRewardError, remote_reward
from rlsys.rewards.sandbox import isolation

USER_MODULE = textwrap.dedent(
    """
    import time

    def score(response, answer, prompt=None, **kw):
        if response == "hang":
            time.sleep(60)
        if response == "boom":
            raise ValueError("boom")
        if response == "nan":
            return float("nan")
        if response == "text":
            return "high"
        return {"score": float(response == answer), "length": len(response), "bonus": kw.get("bonus", 0)}

    def fast(response, answer, prompt=None, **kw):
        return 1.0
    fast.reward_executor = "thread"
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned reward workers inherit sys.path
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def _cfg(name, **kw):
    return SimpleNamespace(**{"name": name, "timeout_s": 2.0, "num_workers": 2, "executor": "auto", "kwargs": {}, **kw})


# ------------------------------------------------------------------ registry


def test_registry_names_and_dotted_paths(user_module):
    assert {"math", "gsm8k", "exact_match", "format", "code", "remote", "synthetic"} <= set(available_rewards())
    assert get_reward_spec("math").executor == "process" and get_reward_spec("remote").batched
    assert get_reward_fn(f"{user_module}:fast")("x", "y") == 1.0
    assert get_reward_spec(f"{user_module}.score").executor == "process"  # user code: may hang
    assert get_reward_spec(f"{user_module}:fast").executor == "thread"  # unless it says otherwise
    with pytest.raises(UserError, match="reward.name: unknown reward 'nope'"):
        get_reward_spec("nope")
    with pytest.raises(UserError, match="cannot import module 'no_such_mod'"):
        get_reward_spec("no_such_mod:f")
    with pytest.raises(UserError, match="has no function 'missing'"):
        get_reward_spec(f"{user_module}:missing")


# ------------------------------------------------------------------ simple rewards


def test_exact_match_and_format():
    assert exact_match("  42 \n", "42") == 1.0 and exact_match("a  b", "a b") == 1.0
    assert exact_match("Paris", "paris") == 0.0 and exact_match("Paris", "paris", ignore_case=True) == 1.0
    assert exact_match("b", ["a", "b"]) == 1.0
    assert format_reward("<think>hmm\nok</think> 42", None) == 1.0
    assert format_reward("42 <think>x</think>", None) == 0.0 and format_reward("<think>x</think>", None) == 0.0
    assert format_reward("ANSWER: 7", None, pattern=r"ANSWER: \d+") == 1.0


@pytest.mark.parametrize(
    "text,strict,expected",
    [
        ("so 3 + 4 = 7\n#### 7", True, 7),
        ("#### 1,234.50", True, 1234.5),
        ("The answer is -12.", False, -12),
        ("costs $18 then 20 more, total 38.", False, 38),
        ("the answer is 5", True, None),
        ("no numbers", False, None),
    ],
)
def test_gsm8k_extraction(text, strict, expected):
    got = extract_final_number(text, strict)
    assert (got is None and expected is None) or float(got) == expected


def test_gsm8k_reward_with_full_gold_solution():
    gold = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert gsm8k_reward("48 + 24 = 72 so the answer is 72", gold) == 1.0
    assert gsm8k_reward("The answer is 71", gold) == 0.0
    assert gsm8k_reward("the answer is 72", gold, strict=True) == 0.0
    with pytest.raises(ValueError, match="gold answer has no number"):
        gsm8k_reward("1", "unknown")


def test_math_reward_with_math_verify():
    pytest.importorskip("math_verify")
    m = get_reward_fn("math")
    assert m("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert m("first \\boxed{3}, finally \\boxed{\\sqrt{4}}", "2") == 1.0  # the last box counts
    assert m("\\boxed{43}", "42") == 0.0
    assert m("The answer is $x = 42$", "$42$") == 1.0
    assert m("no answer here", "7") == 0.0
    assert m("\\boxed{72}", "48/2 = 24 clips in May.\n#### 72") == 1.0  # GSM8K gold solutions work too
    assert last_boxed("a \\boxed{\\frac{a}{b}} b") == "\\frac{a}{b}" and last_boxed("\\boxed{x") is None


# ------------------------------------------------------------------ code sandbox

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
TESTS = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -1", "output": "9"}, ["1 1", "2"]]


def test_code_reward_scores_fraction_of_tests():
    assert code_reward(f"Here:\n```python\n{ADD}```\ndone", TESTS)["score"] == 1.0
    assert code_reward("print(5)", TESTS)["score"] == pytest.approx(1 / 3)
    assert code_reward("raise SystemExit(1)", json.dumps(TESTS))["score"] == 0.0
    apps = {"inputs": ["1 2"], "outputs": ["3"]}
    assert code_reward(ADD, apps) == {"score": 1.0, "all_passed": 1.0, "test_timeouts": 0}
    assert extract_code("```py\na\n```\n```python\nb\n```") == "b\n"


@pytest.mark.skipif(not isolation()[0], reason=f"no sandbox isolation here: {isolation()[1]}")
def test_code_sandbox_limits():
    assert run_program("while True: pass", "", timeout_s=1)[0] == "timeout"
    assert run_program("x = bytearray(3 << 30)", "", memory_mb=512)[0] == "error"
    assert run_program("while True: print('x' * 1000)", "", output_bytes=10_000, timeout_s=3)[0] == "error"
    status, out = run_program("import os, sys; print(os.getcwd(), sys.flags.isolated, 'HTTP_PROXY' in os.environ)", "")
    assert status == "ok" and out.split() == ["/tmp", "1", "False"]  # its private /tmp (tests/unit/test_sandbox.py)


# ------------------------------------------------------------------ remote reward model


class _Handler(BaseHTTPRequestHandler):
    calls: list = []
    fail_first = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        if len(type(self).calls) <= type(self).fail_first:
            self.send_response(503)
            self.end_headers()
            return
        if self.path == "/bad":
            self.send_response(400)
            self.end_headers()
            return
        scores = [float(r == a) for r, a in zip(body["responses"], body["answers"])]
        data = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    _Handler.calls, _Handler.fail_first = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Handler
    server.shutdown()


def test_remote_reward_batches_and_retries(reward_server):
    url, handler = reward_server
    handler.fail_first = 2
    assert remote_reward(["a", "b"], ["a", "a"], ["p", "q"], url=url, backoff_s=0.01) == [1.0, 0.0]
    assert len(handler.calls) == 3 and handler.calls[-1]["prompts"] == ["p", "q"]
    handler.calls.clear()
    handler.fail_first = 0
    with pytest.raises(RemoteRewardError, match="400"):
        remote_reward(["a"], ["a"], [None], url=url + "/bad", backoff_s=0.01)
    assert len(handler.calls) == 1  # a client error is not retried
    with pytest.raises(RemoteRewardError, match="needs reward.kwargs.url"):
        remote_reward(["a"], ["a"], [None])


def test_manager_sends_remote_batches_in_worker_chunks(reward_server):
    url, handler = reward_server
    m = RewardManager(_cfg("remote", kwargs={"url": url}, num_workers=2))
    r = m.score(["a", "b", "c", "x", "e"], ["a", "b", "c", "d", "e"])
    assert r.scores == [1, 1, 1, 0, 1] and len(handler.calls) == 2 and r.metrics["reward/errors"] == 0
    down = RewardManager(_cfg("remote", kwargs={"url": "http://127.0.0.1:9", "retries": 0}))
    r = down.score(["a", "b"], ["a", "b"])
    assert r.scores == [0.0, 0.0] and r.metrics["reward/errors"] == 2


# ------------------------------------------------------------------ manager


BATCH = ["a", "hang", "boom", "b", "nan", "text", "a"]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_manager_failures_score_zero_and_are_counted(user_module, executor):
    with RewardManager(_cfg(f"{user_module}:score", executor=executor, timeout_s=1.0, kwargs={"bonus": 3})) as m:
        start = time.monotonic()
        r = m.score(BATCH, ["a"] * len(BATCH), prompts=["p"] * len(BATCH))
        assert time.monotonic() - start < 10  # the hung sample is cut off after timeout_s
        assert r.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert r.metrics["reward/timeouts"] == 1 and r.metrics["reward/errors"] == 3  # boom, nan, text
        assert r.extras[0] == {"length": 1, "bonus": 3} and r.metrics["reward/bonus"] == 3
        r = m.score(["a", "b"], ["a", "a"], extras=[{"bonus": 1}, {}])  # the pool recovers
        assert r.scores == [1.0, 0.0] and r.metrics["reward/errors"] == 0
        assert r.metrics["reward/errors_total"] == 3 and r.metrics["reward/timeouts_total"] == 1
        assert r.extras[0]["bonus"] == 1 and r.metrics["reward/mean"] == 0.5


def test_process_worker_that_dies_is_replaced(user_module, tmp_path):
    (tmp_path / "dying.py").write_text(
        "import os\n\ndef f(response, answer, prompt=None):\n"
        "    if response == 'die':\n        os._exit(3)\n    return 1.0\n"
    )
    with RewardManager(_cfg("dying:f", executor="process", num_workers=1)) as m:
        r = m.score(["ok", "die", "ok"], [None] * 3)
        assert r.scores == [1.0, 0.0, 1.0] and r.metrics["reward/errors"] == 1
    sys.modules.pop("dying", None)


def test_thread_manager_bounds_concurrency_and_keeps_order(user_module):
    m = RewardManager(_cfg("synthetic", num_workers=3))
    assert m.executor == "thread"
    responses = ["a b c", "a b", "x y z", "a b c d"]
    r = m.score(responses, ["a b c"] * 4)
    assert r.scores == pytest.approx([1.0, 2 / 3, 0.0, 0.75])
    assert m.score([], []).scores == []
