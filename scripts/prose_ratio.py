"""Prose lines (comment lines and docstring lines) per code line, per package of a tree.

    python scripts/prose_ratio.py engine
"""

from __future__ import annotations

import ast
import collections
import io
import sys
import tokenize
from pathlib import Path


def count(path: Path) -> tuple[int, int]:
    """(prose lines, code lines) of one file; a code line with a trailing comment is both."""
    source = path.read_text(encoding="utf-8")
    commented = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                 if tok.type == tokenize.COMMENT}
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    prose = code = 0
    for number, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if not text:
            continue
        if number in docstrings or text.startswith("#"):
            prose += 1
        else:
            code += 1
            prose += number in commented
    return prose, code


def main(root: Path) -> None:
    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for path in root.rglob("*.py"):
        package = path.parts[1] if len(path.parts) > 2 else "(leaves)"
        prose, code = count(path)
        for key in (package, "TOTAL"):
            totals[key]["prose"] += prose
            totals[key]["code"] += code
    for name, t in sorted(totals.items(), key=lambda item: item[0] == "TOTAL"):
        print(f"{name:10s} prose {t['prose']:5d} code {t['code']:5d} "
              f"ratio {t['prose'] / max(1, t['code']):.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "engine"))
