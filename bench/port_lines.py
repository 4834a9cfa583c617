"""How many lines porting the example's plain training script to sdcguard changed.

    python bench/port_lines.py [--diff]

Compares examples/gpt/train_plain.py with examples/gpt/train.py by difflib, leaving out each
file's module docstring (it describes the file, not the training). Prints the insertions and
deletions (``git diff --numstat`` counts: a rewritten line is one of each), the changed lines
counting a replaced block once (``max(removed, added)`` per hunk), and the hunks themselves.
"""
from __future__ import annotations

import argparse
import ast
import difflib
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt"


def code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring."""
    text = path.read_text()
    lines = text.splitlines()
    body = ast.parse(text).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines = lines[body[0].end_lineno:]
    return lines


def count(plain: list[str], ported: list[str]) -> dict[str, int]:
    matcher = difflib.SequenceMatcher(a=plain, b=ported, autojunk=False)
    added = removed = changed = hunks = 0
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        hunks += 1
        removed += a1 - a0
        added += b1 - b0
        changed += max(a1 - a0, b1 - b0)
    return {"insertions": added, "deletions": removed, "changed": changed, "hunks": hunks,
            "plain_lines": len(plain), "ported_lines": len(ported)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", type=Path, default=EXAMPLE / "train_plain.py")
    parser.add_argument("--ported", type=Path, default=EXAMPLE / "train.py")
    parser.add_argument("--diff", action="store_true", help="also print the unified diff")
    args = parser.parse_args()
    plain, ported = code_lines(args.plain), code_lines(args.ported)
    c = count(plain, ported)
    print(f"{args.plain.name} ({c['plain_lines']} lines of code) -> {args.ported.name} ({c['ported_lines']})")
    print(f"  {c['insertions']} insertions(+), {c['deletions']} deletions(-) in {c['hunks']} hunks")
    print(f"  {c['changed']} lines changed (a replaced block counted once)")
    if args.diff:
        for line in difflib.unified_diff(plain, ported, args.plain.name, args.ported.name, n=0, lineterm=""):
            print(line)


if __name__ == "__main__":
    main()
