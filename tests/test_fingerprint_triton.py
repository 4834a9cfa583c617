"""The fused Triton fingerprint kernel, bit for bit against the docs/design.md §3 definition.

No GPU here: the kernel runs in Triton's CPU interpreter, in a subprocess because TRITON_INTERPRET
must be set before triton is imported. The same kernel source is what a GPU compiles."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdcguard.fingerprint import triton_kernel as fingerprint_triton
from sdcguard.fingerprint import fingerprint

triton = pytest.importorskip("triton")
WORKER = Path(__file__).with_name("fingerprint_triton_worker.py")


def test_kernel_matches_the_definition_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONSAFEPATH="1")
    run = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(lines) > 30 and all(line.startswith("ok ") for line in lines), run.stdout


def test_kernel_off_gpu_is_a_clear_error():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        fingerprint(torch.zeros(4), backend="triton")


def test_self_test_fails_closed_with_a_warning(caplog):
    # Where the kernel cannot run, the self-test that guards the automatic choice says no.
    fingerprint_triton._self_test.cache_clear()
    with caplog.at_level(logging.WARNING, logger="sdcguard.fingerprint.triton_kernel"):
        assert not fingerprint_triton.ready(torch.device("cpu"))
    assert "using the torch path" in caplog.text


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        fingerprint(torch.zeros(4), backend="cuda")

