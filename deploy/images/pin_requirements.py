"""Pin an image's Python dependencies: resolve ``.[EXTRA]`` with pip and print ``name==version``.

``make image-requirements`` runs it for both images; the Dockerfiles install exactly these pins,
so an image build does not depend on what the index offers that day.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HEADER = {
    "sidecar": ("sidecar image (Dockerfile.agent)", "agent-requirements.txt"),
    "operator": ("operator image (Dockerfile.operator)", "operator-requirements.txt"),
}


def pins(root: Path, extra: str) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), f"{root}[{extra}]"], check=True)
        items = json.loads(report.read_text())["install"]
    return sorted((f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items
                   if i["metadata"]["name"].lower() != "sdcguard"), key=str.lower)


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    for extra, (what, filename) in HEADER.items():
        lines = [f"# Pinned dependencies of the {what}: pip install '.[{extra}]' resolved",
                 "# with 'pip install --dry-run --report'. No torch. Regenerate with make image-requirements.",
                 *pins(root, extra)]
        (Path(__file__).parent / filename).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
