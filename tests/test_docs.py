"""Every Python example in README.md and docs/*.md runs, or says why it does not.

The rule, for every fenced block whose info string is ``python`` (at any indentation, so a block
inside a list item counts too):

- nothing on the line right before the fence: a complete script. ``test_python_block_runs`` runs
  it with this interpreter (the virtualenv's), in a temporary directory, in one process (no
  process group: a Guard works with a plain module), without the caller's ``SDCGUARD_*``,
  ``POD_*`` and ``NODE_NAME`` variables, under a timeout. Keep such blocks small (a tiny module, a
  few steps): the whole file should stay well under a minute on a loaded 2-core machine.
- ``<!-- fragment -->`` on the line right before the fence: a piece of a larger program (it needs
  a framework, a cluster, a mesh or several processes). It is not run, but it must parse.
- ``<!-- torchrun -->`` on the line right before the fence: a complete multi-process script, run
  under ``torchrun --standalone --nproc_per_node=3`` (gloo) by ``test_torchrun_block_runs``
  (marked ``multiprocess``).

Other fences (``sh``, ``diff``, ``yaml``, ``json``, ``text``) are not Python and not checked here.
The file also checks that every relative link in those pages leads to a file and, with a
``#fragment``, to a heading of it.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
TORCHRUN = "<!-- torchrun -->"
MARKERS = (FRAGMENT, TORCHRUN)
TIMEOUT = 120
"""Per block: a block that takes more than a few seconds on an idle machine is too big for the docs."""

_OPEN = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\n]*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    info: str
    marker: str | None
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (CommonMark's backtick fences; indented ones dedented)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group("indent"), m.group("info").strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a fence that never closes"
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        previous = lines[i - 1].strip() if i > 0 else ""
        found.append(Block(page, i + 1, info, previous if previous in MARKERS else None, "\n".join(body) + "\n"))
        i = end + 1
    return found


def python_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.info.split()[:1] == ["python"]]


ALL = python_blocks()
RUN = [b for b in ALL if b.marker is None]
FRAGMENTS = [b for b in ALL if b.marker == FRAGMENT]
TORCHRUN_BLOCKS = [b for b in ALL if b.marker == TORCHRUN]


def clean_env() -> dict[str, str]:
    """This process's environment without what would change a Guard's settings or identity."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SDCGUARD_", "POD_")) and k not in ("NODE_NAME", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    return env


def test_the_docs_have_examples_of_each_kind():
    assert RUN and FRAGMENTS and TORCHRUN_BLOCKS
    readme = [b for b in RUN if b.page.name == "README.md"]
    assert readme, "the README's first example must be one of the executed blocks"


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_python_block_runs(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_fragment_parses(block):
    try:
        ast.parse(block.code)
    except SyntaxError as exc:
        pytest.fail(f"{block.id}: a fragment must still be Python: {exc}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", TORCHRUN_BLOCKS, ids=[b.id for b in TORCHRUN_BLOCKS])
def test_torchrun_block_runs(block, tmp_path):
    (tmp_path / "train.py").write_text(block.code)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=clean_env(),
    )
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout}\n{proc.stderr}"
    if "checkpoint_every=20" in block.code:  # docs/library.md's training script
        # checkpoint steps are audit steps (checkpoint_every=20): the last one is verified
        assert "finished at step 40" in proc.stdout and "verified up to 40" in proc.stdout, proc.stdout
        assert (tmp_path / "checkpoint-20.pt.sdcguard.json").exists()
        assert (tmp_path / "checkpoint-40.pt").exists()


_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    inside = False
    found = set()
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_lead_somewhere(page):
    broken = []
    for m in _LINK.finditer(page.read_text()):
        target = m.group("target")
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif fragment and where.suffix == ".md" and fragment not in anchors(where):
            broken.append(f"{target}: no heading #{fragment} in {where.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_starts_with_one_line_saying_what_it_covers():
    for page in PAGES[1:]:
        if page.name == "design.md":  # the architecture document keeps its own form
            continue
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[1] == "", page.name
        assert lines[2].startswith("This page covers ") and lines[3] == "", f"{page.name}: {lines[2]!r}"
