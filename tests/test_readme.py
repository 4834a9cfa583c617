"""The README is a front door: a page a newcomer reads in ten minutes, with the manual in docs/.

Its examples run in tests/test_docs.py (the first example among them); the DDP training script
that used to be here is docs/library.md's, run there under torchrun.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MANUAL = ["library", "recovery", "sharded", "integrations", "drill", "operator", "security", "limits", "design"]


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines: move detail into docs/"


def test_the_readme_says_what_a_newcomer_needs():
    text = README.read_text()
    for needed in ["make demo", "make test", "make test-slow",  # the two commands, and CI's second
                   "guard.step(", "s.backward(", "s.check()",  # porting a loop
                   "helm install sdcguard charts/sdcguard",  # installing on Kubernetes
                   "kubectl sdcguard approve"]:  # approving a replacement
        assert needed in text, needed
    first = re.search(r"## A first example\n(.*?)\n## ", text, re.S)
    assert first and "\n```python\n" in first.group(1), "the first example must be an executed Python block"


def test_the_readme_links_every_page_of_the_manual():
    text = README.read_text()
    for page in MANUAL:
        assert f"(docs/{page}.md" in text, page
    assert "(CHANGELOG.md)" in text
