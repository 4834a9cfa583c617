"""The README's training script, run as written under torchrun (3 ranks, gloo)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
README = Path(__file__).parent.parent / "README.md"


def test_readme_example_trains_and_checkpoints(tmp_path):
    text = README.read_text()
    match = re.search(r"<!-- example: train.py -->\n```python\n(.*?)```", text, re.S)
    assert match, "README lost its runnable example"
    (tmp_path / "train.py").write_text(match.group(1))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # checkpoint steps are audit steps (checkpoint_every=20): the last one is verified
    assert "finished at step 40" in proc.stdout and "verified up to 40" in proc.stdout, proc.stdout
    assert (tmp_path / "checkpoint-20.pt.sdcguard.json").exists()
    assert (tmp_path / "checkpoint-40.pt").exists()
