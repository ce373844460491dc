"""The calculator and Python tools (``rollout.multi_turn.env: calculator``).

``calculator(expression)`` evaluates arithmetic (numbers, + - * / // % **, parentheses, unary minus) by
walking its syntax tree: nothing is executed, and exponents and results are bounded so ``9**9**9`` is an
error, not a hung step. ``python(code)`` runs model-written code in the reward sandbox
(``rlsys.rewards.sandbox``: PID, network and mount namespaces, a read-only file system, rlimits) and
returns its stdout; it is offered only with ``tools: [calculator, python]`` in ``env_kwargs``.

``synthetic_calculator`` is the calculator for the built-in synthetic task's word-level vocabulary
(``data.synthetic_task: add`` with tools): ``4 7 + 1 8`` means 47 + 18 and the result is spelled ``6 5``.
"""

from __future__ import annotations

import ast
import operator
import re

from rlsys.envs.base import ToolEnvironment, tool_schema

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_EXPONENT, MAX_DIGITS, MAX_CHARS = 64, 100, 200


def evaluate(expression: str):
    """The value of an arithmetic expression; ``ValueError`` for anything else (names, calls, huge numbers)."""
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return _value(tree.body)


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are not supported")
        try:
            result = _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(result, complex) or (isinstance(result, int) and abs(result) >= 10**MAX_DIGITS):
            raise ValueError("the result is out of range")
        return result
    raise ValueError(f"only numbers and + - * / // % ** are allowed, got {type(node).__name__}")


def format_number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(round(value, 10)) if isinstance(value, float) else str(value)


class CalculatorEnv(ToolEnvironment):
    def __init__(
        self, tools=("calculator",), sandbox_timeout_s: float = 4.0, allow_weak_sandbox: bool = False, call_reward=0.0
    ):
        available = {"calculator": self.calculator, "python": self.python}
        unknown = [t for t in tools if t not in available]
        if unknown:
            raise ValueError(f"unknown calculator tools {unknown}; choose from {sorted(available)}")
        self.functions = {t: available[t] for t in tools}
        self.sandbox_timeout_s, self.allow_weak_sandbox = sandbox_timeout_s, allow_weak_sandbox
        self.call_reward = float(call_reward)
        schemas = {
            "calculator": tool_schema(
                "calculator", "Evaluate an arithmetic expression.", {"expression": "e.g. (17 + 5) * 3"}
            ),
            "python": tool_schema("python", "Run Python code and return what it prints.", {"code": "the program"}),
        }
        self.tools = [schemas[t] for t in tools]

    def calculator(self, expression: str) -> str:
        return format_number(evaluate(str(expression)))  # a ValueError is the model's error message

    def python(self, code: str) -> str:
        from rlsys.rewards.sandbox import Limits, run

        status, out = run(str(code), "", Limits(timeout_s=self.sandbox_timeout_s), self.allow_weak_sandbox)
        if status != "ok":
            raise ValueError(f"the program ended with {status}\n{out}")
        return out


class SyntheticCalculatorEnv(CalculatorEnv):
    """The calculator in the synthetic task's words: digits separated by spaces, results spelled likewise.

    Its shaping is dense, as the synthetic task's reward is and for the same reason (a random model learns
    it from scratch): the first turn that opens a call earns ``call_reward`` times the partial credit of the
    call's text against the question's expression (``synthetic_reward``), half of it if the call is not
    closed. A uniformly random policy almost never writes a whole well-formed call, so a reward for whole
    calls alone gives it nothing to climb (measured: no well-formed call in 200 steps), and neither did a
    quarter of the credit for calls the calculator refuses (none in 200 steps)."""

    def __init__(self, call_reward: float = 0.0):
        super().__init__(tools=("calculator",))
        self.shaping = float(call_reward)

    def reset(self, prompt) -> None:
        super().reset(prompt)
        self.expression = str(prompt.text).removeprefix("add ").removesuffix("=").strip()
        self._shaped = False

    def step(self, action_text: str):
        result = super().step(action_text)
        if "<tool_call>" in action_text and not self._shaped:
            from rlsys.data.synthetic import synthetic_reward

            body = action_text.split("<tool_call>", 1)[1].split("</tool_call>", 1)
            credit = synthetic_reward(body[0].replace("<eos>", " "), self.expression)
            result.reward += self.shaping * credit * (1.0 if len(body) == 2 else 0.5)
            self._shaped = True
        return result

    def calculator(self, expression: str) -> str:
        joined = re.sub(r"(?<=\d) (?=\d)", "", str(expression))
        return " ".join(super().calculator(joined))
