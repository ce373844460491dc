"""Checks of saved multi-turn trajectories of the synthetic calculator task, token by token (the CPU-engine
and real-SGLang tests share them)."""

from __future__ import annotations

from rlsys.controller.replay import Replay, rollout_dir
from rlsys.data.synthetic import SyntheticTokenizer
from rlsys.envs.calculator import SyntheticCalculatorEnv


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` runs of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def check_trajectories(out_dir: str, steps: int, max_turns: int) -> int:
    """Assert every saved trajectory of ``steps`` steps is well formed; returns how many tool calls they hold.

    Each turn that is followed by tool output ends with ``</tool_call>`` (the engine stopped there), the
    output is exactly the calculator's answer to the call's body between the response tags, it has no
    log-probs and no loss, and the model's own tokens have the engine's (negative) log-probs."""
    tok, calc = SyntheticTokenizer(tools=True), SyntheticCalculatorEnv()
    replay, calls = Replay(rollout_dir(out_dir)), 0
    for n in range(1, steps + 1):
        for s in replay.next_batch(n, None).samples:
            assert len(s.loss_mask) == len(s.output_ids) == len(s.logprobs)
            runs = mask_runs(s.loss_mask)
            assert runs[0][0] == 1 and runs[-1][0] == 1  # starts and ends with the model's own tokens
            assert len(runs) <= 2 * max_turns - 1
            for (_, a, b), (glue, c, d) in zip(runs[::2], runs[1::2]):
                assert glue == 0
                turn = tok.decode(s.output_ids[a:b], skip_special_tokens=False).split()
                assert turn[-1] == "</tool_call>" and "<tool_call>" in turn
                body = " ".join(turn[len(turn) - turn[::-1].index("<tool_call>") : -1])
                try:
                    result = calc.calculator(body)
                except ValueError as e:
                    result = f"error: {e}"
                assert s.output_ids[c:d] == tok.encode(f"<tool_response> {result} </tool_response>")
                assert all(lp == 0.0 for lp in s.logprobs[c:d])
                assert all(lp < 0 for lp in s.logprobs[a:b])
                calls += 1
    return calls
