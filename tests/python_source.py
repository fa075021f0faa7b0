"""Python source as a syntax tree, in tests that run beside other threads.

CPython 3.11 keeps the ast module's recursion counter per interpreter, not per thread (python/cpython#106905): a parse
that another thread's parse interleaves with fails with `SystemError: AST constructor recursion depth mismatch`. CI
saw it once, after an earlier test left a thread running in the same worker. The thread switch interval is raised for
the parse, so that no other thread takes the interpreter during it.
"""

import ast
import sys


def parse(source: str) -> ast.Module:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        return ast.parse(source)
    finally:
        sys.setswitchinterval(interval)
