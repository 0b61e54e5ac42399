"""Errors raised while handling another chain it (`raise ... from error`).

An implicit context ("During handling of the above exception, another
exception occurred") reads as a second failure; `from` says the first one is
the cause. `from None` is allowed where hiding the cause is deliberate, with a
comment in the handler saying why. Bare `raise` (re-raising) is always fine.
Static: no cluster, no TensorFlow.
"""

from __future__ import annotations

import ast
import pathlib

from _paths import ROOT

PACKAGE = ROOT / "psclient"


def _raises_in_handlers(tree: ast.AST):
    """(handler, raise) for every `raise X` lexically inside an `except` body.

    A function, lambda or class defined in a handler starts afresh: its
    raises run later, outside the handling.
    """
    found = []

    def visit(node: ast.AST, handler: ast.ExceptHandler | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            handler = None
        if isinstance(node, ast.ExceptHandler):
            for child in node.body:
                visit(child, node)
            return
        if isinstance(node, ast.Raise) and handler is not None and node.exc is not None:
            found.append((handler, node))
        for child in ast.iter_child_nodes(node):
            visit(child, handler)

    visit(tree, None)
    return found


def _reraises_the_handled(handler: ast.ExceptHandler, node: ast.Raise) -> bool:
    return isinstance(node.exc, ast.Name) and node.exc.id == handler.name


def _problems(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    name = path.relative_to(root)
    problems = []
    for handler, node in _raises_in_handlers(ast.parse(source)):
        if _reraises_the_handled(handler, node):
            continue
        if node.cause is None:
            problems.append(f"{name}:{node.lineno}: raise inside `except` without `from`")
        elif isinstance(node.cause, ast.Constant) and node.cause.value is None:
            span = lines[handler.lineno - 1:node.end_lineno]
            if not any("#" in line for line in span):
                problems.append(f"{name}:{node.lineno}: `from None` without a comment saying why")
    return problems


def test_errors_raised_while_handling_another_chain_it():
    problems = [p for path in sorted(PACKAGE.rglob("*.py")) for p in _problems(path)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_it_should(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "try:\n    pass\nexcept OSError as error:\n    raise ValueError('no cause')\n"          # 4: flagged
        "try:\n    pass\nexcept OSError as error:\n    raise ValueError('x') from error\n"      # fine
        "try:\n    pass\nexcept OSError:\n    raise\n"                                         # fine
        "try:\n    pass\nexcept OSError as error:\n    raise error\n"                          # fine
        "try:\n    pass\nexcept OSError:\n    raise ValueError('hidden') from None\n"          # 20: flagged
        "try:\n    pass\nexcept OSError:  # the cause is noise here\n    raise ValueError('y') from None\n"
        "try:\n    pass\nexcept OSError:\n    def later():\n        raise ValueError('later')\n"  # fine
    )
    assert _problems(sample, root=tmp_path) == [
        "sample.py:4: raise inside `except` without `from`",
        "sample.py:20: `from None` without a comment saying why",
    ]
