"""List the longest functions of the graphpass package (issue 9's "readable units" table).

    python tools/func_lengths.py              # functions over 60 lines, longest first
    python tools/func_lengths.py --limit 40   # another threshold
    python tools/func_lengths.py --top 15     # the 15 longest, whatever their length

Lengths count every line from the ``def`` to the function's last line (docstring included), as
``ast`` reports them; nested functions are counted inside their parent and listed on their own.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from tabulate import tabulate

ROOTS = ("graphpass", "backends")


def functions(root: Path):
    for base in ROOTS:
        for path in sorted((root / base).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            stack: list[str] = []

            def visit(node: ast.AST) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        stack.append(child.name)
                        if not isinstance(child, ast.ClassDef):
                            n = child.end_lineno - child.lineno + 1
                            yield_.append((n, f"{path.relative_to(root)}:{child.lineno}", ".".join(stack)))
                        visit(child)
                        stack.pop()
                    else:
                        visit(child)

            yield_: list = []
            visit(tree)
            yield from yield_


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=60, help="list functions longer than this many lines")
    parser.add_argument("--top", type=int, default=0, help="list the N longest instead")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    rows = sorted(functions(root), reverse=True)
    total = len(rows)
    rows = rows[: args.top] if args.top else [r for r in rows if r[0] > args.limit]
    print(tabulate(rows, headers=("lines", "where", "function")))
    print(f"\n{len(rows)} of {total} functions listed" + ("" if args.top else f" (over {args.limit} lines)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
