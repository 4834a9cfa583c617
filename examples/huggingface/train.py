"""Fine-tune a tiny GPT-2 with transformers.Trainer under DDP and sdcguard: train_plain.py ported.

    torchrun --standalone --nproc_per_node=2 examples/huggingface/train.py --steps 12 --audit-every 4

Every optimizer step's gradients are checked before the Trainer clips and steps (NaN/Inf per rank,
the all-reduce's checksum; on audit steps a replay of each rank's micro-batches on another rank,
bit for bit); the weights are compared across replicas every --weight-check-every steps and before
each checkpoint-N folder, which gets a manifest. ``--inject SPEC`` plants a fault. See README.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import sdcguard
import torch
from sdcguard.integrations.huggingface import SdcguardTrainer
from transformers import TrainingArguments

from harness import Harness, TokenData, build_model, parse_args

args = parse_args()
torch.set_num_threads(1)  # the same thread count on every rank: identical arithmetic everywhere
harness = Harness(args)
training_args = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.accum, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=2,
    max_grad_norm=args.max_grad_norm, bf16=args.bf16, save_strategy="steps", save_steps=args.save_steps,
    save_total_limit=args.save_total_limit, logging_steps=1, report_to="none", seed=args.seed,
    use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
)
model, dataset = build_model(args), TokenData(args)
config = sdcguard.Config.from_env(audit_every=args.audit_every, weight_check_every=args.weight_check_every)
trainer = SdcguardTrainer(model=model, args=training_args, train_dataset=dataset, callbacks=[harness], sdcguard_config=config)
with harness.run(trainer):
    trainer.train(resume_from_checkpoint=args.resume)
