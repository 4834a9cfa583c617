"""Pin an image's Python dependencies with their hashes, for ``pip install --require-hashes``.

``make image-requirements`` runs it: for each image it resolves ``.[EXTRA]`` with pip (``pip install
--dry-run --report``) for CPython 3.11 on Linux (glibc, x86_64 and aarch64: the images' platforms)
and writes every requirement as ``name==version`` with the SHA-256 of the wheel pip picks on each
platform. ``build-requirements.txt`` pins what builds the sdcguard wheel itself inside the image
(the ``[build-system] requires`` of pyproject.toml), installed the same way: with these files the
image build takes nothing from the index that a hash does not name.

The versions already in the files are kept (they are passed to pip as constraints); ``--upgrade``
resolves afresh.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = {
    "sidecar": ("sidecar image (Dockerfile.agent)", "agent-requirements.txt"),
    "operator": ("operator image (Dockerfile.operator)", "operator-requirements.txt"),
}
BUILD = "build-requirements.txt"
PYTHON_VERSION = "3.11"
PLATFORMS = {  # pip --platform tags, newest first: what the images' glibc (Debian 12: 2.36) accepts
    "x86_64": ["manylinux_2_36_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"],
    "aarch64": ["manylinux_2_36_aarch64", "manylinux2014_aarch64", "manylinux_2_17_aarch64"],
}


def _report(requirements: list[str], constraints: Path | None, platform: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                   "--report", str(report), "--only-binary=:all:", "--python-version", PYTHON_VERSION,
                   "--implementation", "cp", "--abi", f"cp{PYTHON_VERSION.replace('.', '')}",
                   *(arg for tag in platform for arg in ("--platform", tag))]
        if constraints is not None:
            command += ["--constraint", str(constraints)]
        subprocess.run([*command, *requirements], check=True)
        return json.loads(report.read_text())["install"]


def pins(requirements: list[str], constraints: Path | None) -> list[tuple[str, str, list[str]]]:
    """``(name, version, sha256s)`` of everything ``requirements`` install on the images' platforms."""
    found: dict[str, tuple[str, str, set[str]]] = {}
    for platform in PLATFORMS.values():
        for item in _report(requirements, constraints, platform):
            name, version = item["metadata"]["name"], item["metadata"]["version"]
            if name.lower() == "sdcguard":
                continue
            sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
            key = name.lower()
            if key in found and found[key][1] != version:
                raise SystemExit(f"{name}: {found[key][1]} on one platform, {version} on another; pin it")
            found.setdefault(key, (name, version, set()))[2].add(sha)
    return [(n, v, sorted(h)) for n, v, h in sorted(found.values(), key=lambda e: e[0].lower())]


def render(what: str, regenerate: str, entries: list[tuple[str, str, list[str]]]) -> str:
    lines = [f"# Pinned dependencies of the {what}.",
             f"# The SHA-256 of each wheel (CPython {PYTHON_VERSION}, Linux x86_64 and aarch64), for pip install",
             f"# --require-hashes. {regenerate}"]
    for name, version, hashes in entries:
        lines.append(f"{name}=={version} \\")
        lines += [f"    --hash=sha256:{h}" + (" \\" if i < len(hashes) - 1 else "") for i, h in enumerate(hashes)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    upgrade = "--upgrade" in (argv if argv is not None else sys.argv[1:])
    root = HERE.parents[1]
    regenerate = "Regenerate with make image-requirements."
    for extra, (what, filename) in HEADER.items():
        target = HERE / filename
        constraints = _constraints(target) if target.exists() and not upgrade else None
        text = render(f"{what}: '.[{extra}]' as pip resolves it; no torch", regenerate,
                      pins([f"{root}[{extra}]"], constraints))
        target.write_text(text)
    build = tomllib.loads((root / "pyproject.toml").read_text())["build-system"]["requires"]
    target = HERE / BUILD
    constraints = _constraints(target) if target.exists() and not upgrade else None
    target.write_text(render("wheel build inside both images (pyproject.toml [build-system] requires)",
                             regenerate, pins(build, constraints)))


def _constraints(requirements: Path) -> Path:
    """The ``name==version`` lines of a pinned file, as a constraints file (hashes left out)."""
    pinned = [line.split()[0] for line in requirements.read_text().splitlines()
              if line and not line.startswith(("#", " "))]
    out = Path(tempfile.mkstemp(suffix=".txt")[1])
    out.write_text("\n".join(pinned) + "\n")
    return out


if __name__ == "__main__":
    main()
