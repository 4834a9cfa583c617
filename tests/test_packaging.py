"""What `pip install sdcguard` (a wheel, not the editable install the tests run from) ships."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_for_the_wheel() -> None:
    # The package list is explicit (agent/ and operator/ are mapped onto other names), so a new
    # subpackage missing from it imports fine here and is absent from every built wheel.
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = set()
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join((name, *relative.parts)))
    assert set(tool["packages"]) == on_disk
