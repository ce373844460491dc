"""Multi-turn tool-calling rollouts driven by a scripted policy: exact ids, masks, log-probs and rewards.

The scripted policy stands in for the engines only (fixed responses chosen per turn), so every check
is written out by hand: which tokens the trainer sees, which it trains on, what the reward scores.
The tokenizers are real ``transformers`` tokenizers with chat templates in the Qwen/Hermes and Llama 3
styles, and the built-in synthetic task's word tokenizer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from chat_tokenizers import QWEN_LIKE, byte_tokenizer

from rlsys.config import FiltersConfig, MultiTurnConfig, RewardConfig, SamplingConfig
from rlsys.data.dataset import Prompt, render
from rlsys.data.synthetic import SyntheticTokenizer
from rlsys.envs.base import StepResult, ToolEnvironment
from rlsys.envs.calculator import CalculatorEnv, evaluate
from rlsys.envs.registry import env_class, make_env
from rlsys.envs.search import SearchEnv, questions
from rlsys.envs.tool_calls import tool_format
from rlsys.errors import ConfigError
from rlsys.rewards.manager import RewardManager
from rlsys.rollout.batch import EngineRollout, loss_masks
from rlsys.rollout.chat_glue import ChatGlue
from rlsys.rollout.multi_turn import MultiTurnDriver, final_answer_ids
from rlsys.rollout.protocol import Sample


class ScriptedEngines:
    """The policy: turn k of every trajectory answers ``script[k]`` (text, encoded with the tokenizer), with
    log-prob -0.25 per token; records each request."""

    restarts = 0

    def __init__(self, tokenizer, script: list[str], finish: str = "stop"):
        self.tokenizer, self.script, self.finish, self.requests = tokenizer, script, finish, []
        self.turn_of: dict[tuple, int] = {}

    def generate(self, prompts, params, timeout_s=None):
        self.requests.append((prompts, params))
        out = []
        for i, ctx in enumerate(prompts):
            turn = self._turn(ctx)
            ids = list(self.tokenizer.encode(self.script[turn], add_special_tokens=False))
            finish = self.finish if len(ids) <= params["max_new_tokens"] else "length"  # as an engine cuts it
            ids = ids[: params["max_new_tokens"]]
            out.append(Sample(i, list(ctx), ids, [-0.25] * len(ids), finish, weight_version=str(turn + 1)))
        return out

    def _turn(self, ctx) -> int:
        # the number of earlier requests whose context is a prefix of this one: the trajectory's turn
        return sum(any(len(c) < len(ctx) and list(ctx[: len(c)]) == list(c) for c in r[0]) for r in self.requests[:-1])


def _prompt(tok, text: str, answer: str, tools=None, templated=True) -> Prompt:
    rendered, is_chat = render(text, tok, "tokenizer" if templated else "plain", tools=tools)
    return Prompt(0, rendered, list(tok.encode(rendered, add_special_tokens=not is_chat)), answer, {})


# -- tool-call formats -----------------------------------------------------------------------------


def test_hermes_calls_parse_with_their_errors():
    fmt = tool_format("hermes")
    text = (
        'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "a"} junk'
    )
    calls = fmt.parse(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", {"expression": "2+3"}),
        ("search", {"query": "x"}),
    ]
    assert "not valid JSON" in calls[2].error and '{"name"' in calls[3].error
    assert len(calls) == 4  # the unclosed last block was cut off: not a call
    assert fmt.parse("The answer is 5.") == []
    restarted = fmt.parse('<tool_call>{"na <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert [(c.name, c.error) for c in restarted] == [("f", None)]
    assert fmt.stop == ("</tool_call>",)


def test_llama3_calls_and_prose():
    fmt = tool_format("llama3")
    calls = fmt.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "7*6"}}<|eom_id|>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "7*6"}, None)]
    two = fmt.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "z"}}')
    assert [(c.name, c.arguments) for c in two] == [("a", {}), ("b", {"q": "z"})]
    assert fmt.parse("It is 42.") == []
    assert fmt.parse('{"name": "a", "parameters": {')[0].error.startswith("the tool call is not valid JSON")
    assert fmt.stop_tokens == ("<|eom_id|>",)


def test_format_follows_the_chat_template():
    assert tool_format("auto", byte_tokenizer("llama")).name == "llama3"
    qwen = byte_tokenizer("qwen")
    assert tool_format("auto", qwen).name == "hermes"  # a template without a tool syntax of its own: Hermes
    assert tool_format("auto", SyntheticTokenizer(tools=True)).name == "tags"  # no template at all
    with pytest.raises(ValueError, match="unknown tool format"):
        tool_format("xml")


# -- the environments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression,value", [("2+3*4", 14), ("(17 + 5) * 3", 66), ("-2**3", -8), ("7/2", 3.5), ("7//2 % 3", 0)]
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression,why",
    [
        ("__import__('os')", "only numbers"),
        ("9**9**9", "exponents above"),
        ("1/0", "division by zero"),
        ("1+" * 200 + "1", "longer than"),
        ("x + 1", "only numbers"),
        ("2 +", "not an arithmetic expression"),
    ],
)
def test_calculator_refuses_everything_else(expression, why):
    with pytest.raises(ValueError, match=why):
        evaluate(expression)


def test_tool_errors_are_observations_not_failures():
    env = CalculatorEnv()
    env.tool_format = tool_format("hermes")
    env.reset(None)
    r = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    assert (r.observation, r.done, r.info) == ("error: division by zero", False, {"tool_calls": 1, "tool_errors": 1})
    r = env.step('<tool_call>{"name": "shell", "arguments": {}}</tool_call>')
    assert r.observation.startswith("error: unknown tool 'shell'")
    r = env.step('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')
    assert r.observation.startswith("error: bad arguments")
    assert env.step("The answer is 3.") == StepResult(None, done=True)


def test_python_tool_runs_in_the_sandbox():
    from rlsys.rewards.sandbox import isolation

    if not isolation()[0]:
        pytest.skip(f"the sandbox cannot isolate here: {isolation()[1]}")
    env = CalculatorEnv(tools=("calculator", "python"))
    env.tool_format = tool_format("hermes")
    code = f"import os\nprint(sum(range(10)), os.path.exists({__file__!r}))"
    r = env.step(json.dumps({"name": "python", "arguments": {"code": code}}).join(["<tool_call>", "</tool_call>"]))
    assert r.observation.split() == ["45", "False"]  # ran, and the project's files were out of its reach


def test_search_finds_the_passage_that_answers():
    env = SearchEnv(top_k=1)
    for q in questions(30, seed=3):
        hit = env.search(q["prompt"])
        assert q["answer"] in hit, (q, hit)
    assert env.search("zzzz qqqq") == "no results"
    assert SearchEnv().index is env.index  # one index per corpus


def test_registry_names_the_key_to_fix(tmp_path):
    assert env_class("calculator") is CalculatorEnv
    with pytest.raises(ConfigError, match="rollout.multi_turn.env.*unknown environment"):
        env_class("nope")
    with pytest.raises(ConfigError, match="cannot import module"):
        env_class("no_such_pkg.mod:Env")
    with pytest.raises(ConfigError, match="not a subclass"):
        env_class("json:JSONDecoder")
    with pytest.raises(ConfigError, match="rollout.multi_turn.env_kwargs.*refused"):
        make_env("calculator", {"tools": ["rm"]}, tool_format("hermes"))


# -- the driver ------------------------------------------------------------------------------------


def _driver(tok, engines, templated=True, **cfg):
    cfg = MultiTurnConfig(**{"env": "calculator", "max_turns": 3, "max_total_tokens": 400, **cfg})
    return MultiTurnDriver(engines, tok, cfg, templated)


def test_hermes_trajectory_ids_masks_and_logprobs():
    tok = byte_tokenizer("qwen")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    final = "The answer is 42.<|im_end|>"
    engines = ScriptedEngines(tok, [call, final])
    prompt = _prompt(tok, "What is 6*7?", "42", tools=CalculatorEnv().tools)
    assert "<tools>" in prompt.text and '"calculator"' in prompt.text  # the tools are described to the model
    driver = _driver(tok, engines)
    samples, metrics = driver.generate([prompt], {"n": 2, "max_new_tokens": 200, "stop_token_ids": [tok.eos_token_id]})

    glue = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    call_ids, glue_ids, final_ids = (tok.encode(t, add_special_tokens=False) for t in (call, glue, final))
    for s in samples:
        assert s.prompt_ids == prompt.ids
        assert s.output_ids == call_ids + glue_ids + final_ids  # the model's ids untouched, the glue between
        assert s.loss_mask == [1] * len(call_ids) + [0] * len(glue_ids) + [1] * len(final_ids)
        assert s.logprobs == [-0.25] * len(call_ids) + [0.0] * len(glue_ids) + [-0.25] * len(final_ids)
        assert final_answer_ids(s) == final_ids
        assert s.weight_version == "1" and s.weight_version_spans[-1][0] == "2"  # turn 2 came from version 2
    # turn 2 continued the whole context; the format's stop string was asked for
    (first, p1), (second, _) = engines.requests
    assert second[0] == prompt.ids + call_ids + glue_ids and "</tool_call>" in p1["stop"] and p1["n"] == 1
    assert metrics["rollout/tool_use"] == 1.0 and metrics["rollout/turns_mean"] == 2.0
    assert metrics["rollout/tool_tokens_mean"] == len(glue_ids)


def test_llama3_trajectory_glue_after_eom():
    tok = byte_tokenizer("llama")
    call = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+2"}}<|eom_id|>'
    engines = ScriptedEngines(tok, [call, "4<|eot_id|>"])
    driver = _driver(tok, engines)
    assert driver.format.name == "llama3" and driver.stop_ids == [tok.convert_tokens_to_ids("<|eom_id|>")]
    samples, _ = driver.generate([_prompt(tok, "2+2?", "4")], {"n": 1, "max_new_tokens": 100})
    text = tok.decode(samples[0].output_ids, skip_special_tokens=False)
    # the turn ended with <|eom_id|> where the template closes with <|eot_id|>: all of the template's end is glue
    assert text == call + "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n4<|eot_id|>" \
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"  # fmt: skip


def test_plain_glue_for_the_synthetic_task():
    tok = SyntheticTokenizer(tools=True)
    engines = ScriptedEngines(tok, ["<tool_call> 4 7 + 1 8 </tool_call>", "6 5 <eos>"])
    driver = _driver(tok, engines, templated=False, env="synthetic_calculator", env_kwargs={"call_reward": 0.25})
    prompt = _prompt(tok, "add 4 7 + 1 8 =", "6 5", templated=False)
    samples, _ = driver.generate([prompt], {"n": 1, "max_new_tokens": 8})
    s = samples[0]
    assert tok.decode(s.output_ids, skip_special_tokens=False) == (
        "<tool_call> 4 7 + 1 8 </tool_call> <tool_response> 6 5 </tool_response> 6 5 <eos>"
    )
    assert s.loss_mask == [1] * 7 + [0] * 4 + [1] * 3 and s.env_reward == 0.25


def test_engine_rollout_scores_the_final_answer_plus_env_rewards():
    tok = SyntheticTokenizer(tools=True)

    class Prompts:
        tokenizer, batch_size, batches = tok, 1, 0

        def next_batch(self):
            return [_prompt(tok, "add 4 7 + 1 8 =", "6 5", templated=False)]

    engines = ScriptedEngines(tok, ["<tool_call> 4 7 + 1 8 </tool_call>", "6 5 <eos>"])
    driver = _driver(tok, engines, templated=False, env="synthetic_calculator", env_kwargs={"call_reward": 0.25})
    rewards = RewardManager(RewardConfig(name="synthetic", num_workers=1, executor="thread"))
    try:
        source = EngineRollout(
            engines, Prompts(), rewards, SamplingConfig(n=2, max_new_tokens=8), FiltersConfig(), 0, driver
        )
        rolled = source.next_batch(1, _NoTimer())
    finally:
        rewards.close()
    assert rolled.texts == ["6 5", "6 5"]  # the tool call and its output are not what is scored
    assert rolled.scores.tolist() == [1.25, 1.25]
    masks = loss_masks(rolled.samples)
    assert [m.tolist() for m in masks] == [[1.0] * 7 + [0.0] * 4 + [1.0] * 3] * 2
    assert rolled.metrics["rollout/tool_use"] == 1.0


class _NoTimer:
    def __call__(self, name):
        import contextlib

        return contextlib.nullcontext()


def test_turn_and_token_caps():
    tok = SyntheticTokenizer(tools=True)
    loop = ["<tool_call> 1 + 1 </tool_call>"] * 5
    samples, metrics = _driver(
        tok, ScriptedEngines(tok, loop), False, env="synthetic_calculator", max_turns=2
    ).generate([_prompt(tok, "add 1 + 1 =", "2", templated=False)], {"n": 1, "max_new_tokens": 8})
    assert samples[0].finish_reason == "max_turns" and metrics["rollout/turns_mean"] == 2
    assert samples[0].loss_mask[-1] == 1  # no tool output after the last turn: it was never run
    samples, _ = _driver(
        tok, ScriptedEngines(tok, loop), False, env="synthetic_calculator", max_total_tokens=12
    ).generate([_prompt(tok, "add 1 + 1 =", "2", templated=False)], {"n": 1, "max_new_tokens": 8})
    assert len(samples[0].output_ids) <= 12 and samples[0].finish_reason == "length"


class SlowOrBroken(ToolEnvironment):
    release = threading.Event()  # "hang": the tool answers once the test sets it (each test sets its own)

    def __init__(self, mode: str):
        self.mode = mode
        self.functions = {"f": self.f}

    def step(self, action_text):
        if "<tool_call>" in action_text and self.mode == "raise":
            raise RuntimeError("the environment broke")
        if "<tool_call>" in action_text and self.mode == "hang":
            self.release.wait(60)  # until the test releases it; a driver waiting for it fails, not hangs
        if "<tool_call>" in action_text and self.mode == "garbage":
            return "not a StepResult"
        return super().step(action_text)

    def f(self, x):
        return x


@pytest.mark.parametrize(
    "mode,observation,counter",
    [
        ("raise", "error: RuntimeError: the environment broke", "env_errors"),
        ("hang", "error: the tool did not answer within 0.5 s", "tool_timeouts"),
        ("garbage", "error: the environment returned str, not a StepResult", "env_errors"),
    ],
)
def test_a_failing_environment_is_an_observation(mode, observation, counter, monkeypatch):
    import rlsys.envs.registry as registry

    monkeypatch.setitem(registry.BUILTIN, "broken", f"{__name__}:SlowOrBroken")
    monkeypatch.setattr(SlowOrBroken, "release", threading.Event())
    tok = SyntheticTokenizer(tools=True)
    engines = ScriptedEngines(tok, ["<tool_call> a </tool_call>", "a <eos>"])
    driver = _driver(tok, engines, False, env="broken", env_kwargs={"mode": mode}, tool_timeout_s=0.5)
    start = time.monotonic()
    try:
        samples, metrics = driver.generate(
            [_prompt(tok, "copy a =", "a", templated=False)], {"n": 1, "max_new_tokens": 8}
        )
        took = time.monotonic() - start
    finally:
        SlowOrBroken.release.set()  # the held tool answers now, after the driver gave up on it
    # the point for "hang": the driver stops waiting at tool_timeout_s (0.5 s), not when the tool answers (held
    # until after this line). Measured 0.50 s on 2 busy cores: 5 s is a 10x margin.
    assert took < 5
    glue = [t for t, m in zip(samples[0].output_ids, samples[0].loss_mask) if not m]
    shown = tok.decode(glue, skip_special_tokens=False)
    assert shown.startswith("<tool_response>") and metrics[f"rollout/{counter}_mean"] == 1.0
    assert len(tok.encode(observation)) == len(glue) - 2  # the error text, between the response tags
    driver.close()


def test_templates_that_ignore_tools_get_them_in_a_system_turn():
    tok = byte_tokenizer("qwen")
    tok.chat_template = QWEN_LIKE.replace("{%- if tools %}", "{%- if false %}")  # as SmolLM2's template does
    text, _ = render("What is 6*7?", tok, "tokenizer", tools=CalculatorEnv().tools)
    assert text.startswith("<|im_start|>system\nYou may call one or more functions") and "<tool_call>" in text


def test_chat_glue_refuses_a_template_that_rewrites_history():
    tok = byte_tokenizer("qwen")
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ConfigError, match="renders the conversation before a tool message differently"):
        ChatGlue(tok, True).text("ASSISTANT", ["obs"])


def test_chat_glue_with_a_template_that_renders_the_last_assistant_turn_apart():
    """Qwen3's template gives only the last assistant message an empty <think> block."""
    tok = byte_tokenizer("qwen")
    tok.chat_template = QWEN_LIKE.replace(
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}",
        "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m.content }}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}",
    )
    glue = ChatGlue(tok, True).text('<tool_call>{"name": "f"}</tool_call>', ["42"])
    assert (
        glue == "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_loss_masks_only_for_multi_turn_batches():
    single = Sample(0, [1], [2, 3], [-1.0, -1.0], "stop")
    assert loss_masks([single]) is None
    multi = Sample(0, [1], [2, 3, 4], [-1.0, 0.0, -1.0], "stop", loss_mask=[1, 0, 1])
    assert [m.tolist() for m in loss_masks([single, multi])] == [[1.0, 1.0], [1.0, 0.0, 1.0]]
    assert torch.equal(loss_masks([multi])[0], torch.tensor([1.0, 0.0, 1.0]))


def test_learn_trains_only_the_models_tokens(tmp_path):
    """Stage 4-6 on multi-turn samples: the loss mask reaches the update, and the advantages of tool output
    and glue are 0 (with the mismatch correction on, whose rejection mask must keep the glue out too)."""
    from test_step import _run

    from rlsys.controller.loop import learn
    from rlsys.controller.metrics import Timer
    from rlsys.rollout.batch import RolloutBatch

    run, _, actor = _run(tmp_path, syncing=False, overrides=["algorithm.mismatch.mode=mis"])
    mask = [1, 1, 0, 0, 1]
    samples = [
        Sample(0, [3, 4], [5, 6, 7, 8, 9], [-0.5, -0.5, 0.0, 0.0, -0.5], "stop", loss_mask=mask),
        Sample(0, [3, 4], [5, 6, 1], [-0.5, -0.5, -0.5], "stop", loss_mask=[1, 1, 1]),
    ]
    rolled = RolloutBatch(samples, ["a", "b"], torch.tensor([1.0, 0.0]), [0, 0], {})
    try:
        learn(run, 1, rolled, Timer())
    finally:
        run.close()
    ((batch, _),) = actor.updates
    assert batch.fields["loss_mask"][0].tolist() == mask
    adv = batch.fields["advantages"][0]
    assert adv[2] == 0 and adv[3] == 0 and adv[0] > 0  # the better trajectory's own tokens are pushed up


class NeverReturns(ToolEnvironment):
    """A tool call blocks forever (on an event nobody sets)."""

    def __init__(self):
        self.functions = {"f": self.f}

    def step(self, action_text):
        if "<tool_call>" in action_text:
            threading.Event().wait()
        return super().step(action_text)

    def f(self, x):
        return x


def test_steps_that_never_return_neither_starve_the_pool_nor_hold_the_process(monkeypatch):
    """Each stuck step gives up its worker after the timeout: with one worker, later rounds still run, and a
    step that never returns does not keep the process from exiting (its thread is a daemon)."""
    import rlsys.envs.registry as registry

    monkeypatch.setitem(registry.BUILTIN, "never", f"{__name__}:NeverReturns")
    tok = SyntheticTokenizer(tools=True)
    engines = ScriptedEngines(tok, ["<tool_call> a </tool_call>", "<tool_call> a </tool_call>", "a <eos>"])
    driver = _driver(tok, engines, False, env="never", tool_timeout_s=0.3, concurrency=1, max_turns=3)
    start = time.monotonic()
    samples, metrics = driver.generate([_prompt(tok, "copy a =", "a", templated=False)], {"n": 1, "max_new_tokens": 8})
    # the point: two stuck calls in a row on a single worker, each given up after 0.3 s, not waited for (they
    # never return). Measured 0.61 s on 2 busy cores: 5 s is an 8x margin.
    assert time.monotonic() - start < 5
    assert metrics["rollout/tool_timeouts_mean"] == 2.0 and driver._pool.abandoned == 2
    driver.close()
    code = (
        "import threading\n"
        "from rlsys.rollout.daemon_pool import DaemonPool\n"
        "pool = DaemonPool(1, 'test')\n"
        "started = threading.Event()\n"
        "f = pool.submit(lambda: (started.set(), threading.Event().wait()))\n"
        "assert started.wait(30)\n"  # the worker runs it: abandon must replace the worker, not cancel a queued call
        "pool.abandon(f)\n"
        "assert pool.submit(lambda: 7).result(timeout=5) == 7\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_environment_that_keeps_hanging_stops_the_run(monkeypatch):
    import rlsys.envs.registry as registry
    import rlsys.rollout.daemon_pool as daemon_pool

    monkeypatch.setitem(registry.BUILTIN, "never", f"{__name__}:NeverReturns")
    monkeypatch.setattr(daemon_pool, "MAX_ABANDONED_PER_WORKER", 1)
    tok = SyntheticTokenizer(tools=True)
    engines = ScriptedEngines(tok, ["<tool_call> a </tool_call>"] * 4)
    driver = _driver(tok, engines, False, env="never", tool_timeout_s=0.2, concurrency=1, max_turns=4)
    with pytest.raises(RuntimeError, match=r"2 steps never returned \(each keeps a thread.*tool_timeout_s=0.2"):
        driver.generate([_prompt(tok, "copy a =", "a", templated=False)], {"n": 1, "max_new_tokens": 8})
    driver.close()
