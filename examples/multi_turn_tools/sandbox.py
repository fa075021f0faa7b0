"""The calculator tool, run in a restricted sandbox: a fresh isolated Python process (`-I -S`: no site packages,
no user paths) with a CPU-time and memory limit, a wall-clock timeout, and an evaluator that accepts arithmetic only
(numbers, + - * / // % **, parentheses): no names, calls or attributes, so nothing can be imported or reached.

`await calculate("12*7")` returns the result as text, or "error: …" for anything else.
"""

import ast
import asyncio
import operator
import resource
import sys

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_CHARS = 100
MAX_EXPONENT = 64
TIMEOUT_S = 10.0  # wall clock, for a process that waits (the CPU limit stops a busy one); slow starts under load
CPU_SECONDS = 1
MEMORY_BYTES = 256 * 1024 * 1024

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


async def calculate(expression: str) -> str:
    """Evaluates `expression` in the sandbox process; never raises."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", __file__,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(expression.encode()), TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return "error: timed out"
    text = out.decode(errors="replace").strip()
    return text[:MAX_RESULT_CHARS] if proc.returncode == 0 else (text or "error: the calculator failed")


def _limit() -> None:
    """Set by the sandbox process on itself, first thing (a preexec_fn would fork the whole gateway)."""
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def evaluate(expression: str) -> int | float:
    """Arithmetic only; anything else raises ValueError naming what is not allowed."""
    return _eval(ast.parse(expression.strip(), mode="eval").body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers and + - * / // % ** ( )")


if __name__ == "__main__":
    _limit()
    try:
        value = evaluate(sys.stdin.read())
        text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        if len(text) > MAX_RESULT_CHARS:
            raise ValueError(f"result longer than {MAX_RESULT_CHARS} digits")
        print(text)
    except (ValueError, SyntaxError, ArithmeticError, RecursionError, MemoryError) as e:
        print(f"error: {type(e).__name__}: {e}")
        sys.exit(1)
