"""The calculator tool the chat model learns to call between <|python_start|> and <|python_end|>.

A whitelist evaluator over Python's AST: numbers, + - * / // % **, unary signs, parentheses, and
`'word'.count('x')` for letter counting. No names, calls or attributes beyond that, bounded exponents
and sizes, and a wall-clock limit, so a model (or a user) cannot make it do anything else.
"""
from __future__ import annotations

import ast
import math
import operator
import signal
import threading

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPR_CHARS = 200
MAX_MAGNITUDE = 10 ** 30


class CalculatorError(ValueError):
    pass


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10 ** 6):
            raise CalculatorError("exponent too large")
        out = _BINOPS[type(node.op)](left, right)
        if isinstance(out, (int, float)) and abs(out) > MAX_MAGNITUDE:
            raise CalculatorError("result too large")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and not node.keywords
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.func.value.value.count(node.args[0].value)
    raise CalculatorError(f"unsupported expression: {ast.dump(node)[:60]}")


def format_number(x) -> str:
    if isinstance(x, float):
        if x.is_integer():
            return str(int(x))
        return f"{x:.6g}"
    return str(x)


def calculate(expr: str, timeout_s: float = 0.1) -> str:
    """Evaluate `expr`; returns the result as text, or raises CalculatorError."""
    expr = expr.strip()
    if not expr or len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError("empty or too long expression")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"syntax error: {e.msg}") from None
    # the AST bounds make evaluation fast; the alarm is a second guard where signals are available. It
    # counts this process's CPU time, not the wall clock: on a loaded machine a process can wait longer than
    # timeout_s for a core, and a wall-clock alarm then failed a trivial sum (and with it data generation)
    use_alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if use_alarm:
        def _timeout(*_):
            raise CalculatorError("timed out")
        old = signal.signal(signal.SIGVTALRM, _timeout)
        signal.setitimer(signal.ITIMER_VIRTUAL, timeout_s)
    try:
        value = _eval(tree)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as e:  # 1e6 ** 64 and friends: the tool's error, no crash
        raise CalculatorError(f"cannot compute: {e}") from None
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            signal.signal(signal.SIGVTALRM, old)
    # a real, finite number (or a count) only: (-8) ** 0.5 is complex, 1e308 * 10 is inf
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise CalculatorError(f"not a finite real number: {value}")
    return format_number(value)


def try_calculate(expr: str) -> str:
    """Tool result as the model sees it: the value, or 'error'."""
    try:
        return calculate(expr)
    except CalculatorError:
        return "error"


def calculator_tool(tok):
    """The engine's tool callback for a tokenizer `tok`: expression ids -> ids to force-feed,
    <|output_start|> result <|output_end|>, exactly as the training data renders a tool output."""
    start, end = tok.special["<|output_start|>"], tok.special["<|output_end|>"]

    def tool(expr_ids: list[int]) -> list[int]:
        return [start, *tok.encode(try_calculate(tok.decode(expr_ids))), end]

    return tool
