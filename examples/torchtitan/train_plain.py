"""A tiny torchtitan job, launched as torchtitan's own ``train.py`` launches it: build the config,
``config.build()`` the Trainer, ``trainer.train()``.

    torchrun --standalone --nproc_per_node=4 examples/torchtitan/train_plain.py --replicate 2 --shard 2

The config (a tiny llama3, an in-code tokenizer and random-token data, CPU and gloo) is tiny.py's;
examples/torchtitan/train.py is the same job with sdcguard.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import tiny  # noqa: E402 - first: it points torchtitan at the CPU before torchtitan is imported
from harness import parse_args, run  # noqa: E402

args = parse_args()
config = tiny.tiny_config(args)
run(config, args)
