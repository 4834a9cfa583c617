"""Bad drill input: a one-line error and exit status 2, before any process starts."""
import subprocess
import sys

import pytest

CASES = [
    (["--inject", "cosmic-ray:rank=0:step=1"], "unknown fault kind 'cosmic-ray'"),
    (["--inject", "grad-inf:rank=6:step=1"], "rank 6 in 'grad-inf:rank=6:step=1' is out of range"),
    (["--world-size", "6", "--ranks-per-node", "4"], "world size 6 is not divisible by --ranks-per-node 4"),
    (["--world-size", "6", "--nodes", "2"], "--world-size 6 != --nodes 2 x --ranks-per-node 2"),
    (["--inject", "grad-inf:rank=1"], "lacks step=S"),
    (["--inject", "grad-inf:rank=1:step=two"], "step must be an integer"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--audit-every", "-3"], "--audit-every must be >= 0"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[c[1][:30] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", *args, "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith("sdcguard drill: error:")
    assert proc.stdout == ""  # the drill prints its header before it launches anything
    assert not (tmp_path / "r.json").exists()


def test_unknown_option_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", "--nodez", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments: --nodez" in proc.stderr
