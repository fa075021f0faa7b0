"""Python source as a syntax tree, in tests that run beside other threads and leftover objects.

CPython 3.11 keeps the ast module's recursion counter per interpreter, not per call (python/cpython#106905): a parse
that another parse interleaves with fails with `SystemError: AST constructor recursion depth mismatch`. CI saw it
twice. Once another thread's parse came in between; the thread switch interval is raised for the parse, so that no
other thread takes the interpreter during it. Once a garbage collection during the parse finalized a task an earlier
test had left pending, and printing its error parsed the traceback's lines (3.11 marks the failing expression with
carets); the collector is off for the parse.
"""

import ast
import gc
import sys


def parse(source: str) -> ast.Module:
    interval, collecting = sys.getswitchinterval(), gc.isenabled()
    sys.setswitchinterval(60.0)
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if collecting:
            gc.enable()
        sys.setswitchinterval(interval)
