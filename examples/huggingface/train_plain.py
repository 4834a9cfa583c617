"""Fine-tune a tiny GPT-2 with transformers.Trainer under DDP, without sdcguard: the starting point.

    torchrun --standalone --nproc_per_node=2 examples/huggingface/train_plain.py --steps 12

train.py is this script ported to sdcguard; ``python bench/port_lines.py`` counts the lines the
port changed. Flags, the model, the data and the result files live in harness.py, shared by both.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import torch
from transformers import Trainer, TrainingArguments

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
trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[harness])
with harness.run(trainer):
    trainer.train(resume_from_checkpoint=args.resume)
