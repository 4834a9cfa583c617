"""How many lines porting each example's plain training script to sdcguard changed.

    python bench/port_lines.py [--diff] [--plain P --ported Q]

Compares, in every folder under examples/ that has both, train_plain.py (the script without
sdcguard) with train.py (the same script with it) by difflib, leaving out each file's module
docstring (it describes the file, not the training). Prints the insertions and
deletions (``git diff --numstat`` counts: a rewritten line is one of each), the changed lines
counting a replaced block once (``max(removed, added)`` per hunk), and the hunks themselves.
"""
from __future__ import annotations

import argparse
import ast
import difflib
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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


def pairs() -> list[tuple[Path, Path]]:
    """Every example folder's (train_plain.py, train.py)."""
    return [(plain, plain.with_name("train.py")) for plain in sorted(EXAMPLES.glob("*/train_plain.py"))
            if plain.with_name("train.py").exists()]


def report(plain_path: Path, ported_path: Path, diff: bool) -> None:
    plain, ported = code_lines(plain_path), code_lines(ported_path)
    c = count(plain, ported)
    where = plain_path.parent.name
    print(f"{where}/{plain_path.name} ({c['plain_lines']} lines of code) -> "
          f"{where}/{ported_path.name} ({c['ported_lines']})")
    print(f"  {c['insertions']} insertions(+), {c['deletions']} deletions(-) in {c['hunks']} hunks")
    print(f"  {c['changed']} lines changed (a replaced block counted once)")
    if diff:
        for line in difflib.unified_diff(plain, ported, plain_path.name, ported_path.name, n=0, lineterm=""):
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", type=Path, help="compare only this script ...")
    parser.add_argument("--ported", type=Path, help="... with this one")
    parser.add_argument("--diff", action="store_true", help="also print the unified diff")
    args = parser.parse_args()
    if (args.plain is None) != (args.ported is None):
        parser.error("--plain and --ported go together")
    for plain, ported in [(args.plain, args.ported)] if args.plain else pairs():
        report(plain, ported, args.diff)


if __name__ == "__main__":
    main()
