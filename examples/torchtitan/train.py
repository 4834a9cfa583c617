"""The tiny torchtitan job of train_plain.py with sdcguard's checks in every step: the config's
class is sdcguard's GuardedTrainer's (torchtitan's Trainer with an ``sdcguard`` section).

    torchrun --standalone --nproc_per_node=4 examples/torchtitan/train.py --replicate 2 --shard 2 \
        [--inject grad-bitflip:rank=1:step=3]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import tiny  # noqa: E402 - first: it points torchtitan at the CPU before torchtitan is imported
from harness import parse_args, run, sdcguard_section  # noqa: E402
from sdcguard.integrations.torchtitan import GuardedTrainer  # noqa: E402

args = parse_args()
config = tiny.tiny_config(args, GuardedTrainer.Config, sdcguard=sdcguard_section(args))
run(config, args)
