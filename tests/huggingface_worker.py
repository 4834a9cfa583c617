"""One torchrun job, several short runs in turn (start-up is paid once): for each fault kind a
transformers.Trainer run of examples/huggingface with that fault planted; a bfloat16 run with and
without sdcguard; a run whose
checkpoint-N folders rotate under save_total_limit=1 while a fault's window reaches back past
the newest folders; and a plain Accelerate loop against the same loop through accelerate_guard,
then with a fault. Each run writes OUT/<name>/result-rank<R>.json (see examples/huggingface/harness.py).

    torchrun --nproc_per_node=3 tests/huggingface_worker.py OUT PLAN.json
"""
import contextlib
import json
import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "huggingface"
sys.path.insert(0, str(EXAMPLE))

import sdcguard  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import Trainer, TrainingArguments, get_cosine_schedule_with_warmup  # noqa: E402

from harness import PARAM, SITE, Harness, TokenData, build_model, parse_args  # noqa: E402
from sdcguard.faults import FaultInjector, parse_fault  # noqa: E402
from sdcguard.fingerprint import digest, fingerprint  # noqa: E402
from sdcguard.integrations.huggingface import SdcguardTrainer, accelerate_guard  # noqa: E402


def trainer_run(out: Path, flags: list[str], extra: dict, guarded: bool = True) -> None:
    """examples/huggingface/train.py's run (train_plain.py's without ``guarded``), in-process
    (the process group stays up)."""
    args = parse_args(["--out", str(out), *flags])
    harness = Harness(args)
    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accum, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=args.max_grad_norm, bf16=args.bf16, save_strategy="steps", save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, logging_steps=1, report_to="none", seed=args.seed,
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
    )
    config = sdcguard.Config.from_env(audit_every=args.audit_every, weight_check_every=args.weight_check_every,
                                      spool=str(out / "spool"), **extra)
    common = {"model": build_model(args), "args": training_args, "train_dataset": TokenData(args), "callbacks": [harness]}
    trainer = SdcguardTrainer(**common, sdcguard_config=config) if guarded else Trainer(**common)
    with harness.run(trainer, teardown=False):
        trainer.train(resume_from_checkpoint=args.resume)


def accelerate_run(out: Path, guarded: bool, inject: list[str], steps: int = 6, accum: int = 2) -> None:
    """A user's own Accelerate loop: prepare, accumulate with no_sync, clip, AdamW, cosine schedule."""
    args = parse_args(["--out", str(out)])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    accelerator = Accelerator(cpu=True)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = torch.utils.data.DataLoader(TokenData(args), batch_size=args.batch_size, shuffle=False)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 2, steps * world)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def loss_fn(module, batch):
        return module(**batch).loss

    record = {"rank": rank, "losses": {}, "weights": {}, "alarms": [], "errors": []}
    injector = FaultInjector([parse_fault(s, world) for s in inject], rank)
    if guarded:
        injector.install(accelerator.unwrap_model(model), optimizer.optimizer, site=SITE, param=PARAM)
        config = sdcguard.Config.from_env(audit_every=2, weight_check_every=1, spool=str(out / "spool"))
        guard = accelerate_guard(accelerator, model, optimizer, loss_fn, config=config, reduce_hook=injector.reduce_hook)
    batches = iter(loader)
    try:
        for step in range(1, steps + 1):
            micro = [next(batches) for _ in range(accum)]
            if guarded:
                injector.begin_step(step)
                with guard.step(step, micro_batches=accum) as s:
                    for m in micro:
                        s.backward(m, divide_by=accum)
                    s.check()
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                loss = s.loss
            else:
                losses = []
                for i, m in enumerate(micro):
                    with accelerator.no_sync(model) if i < accum - 1 else contextlib.nullcontext():
                        loss = loss_fn(model, m)
                        accelerator.backward(loss / accum)
                        losses.append(loss.detach())
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                loss = sum(losses) / accum
            record["losses"][step] = loss.item()
            record["weights"][step] = digest(fingerprint(p.detach()) for p in model.parameters()).hex()
    except sdcguard.SDCDetected as alarm:
        record["alarms"].append(alarm.alarm)
        record["errors"].append({"step": step, "type": "SDCDetected"})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result-rank{rank}.json").write_text(json.dumps(record, indent=1, sort_keys=True, default=str))


def main() -> None:
    out, plan = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    torch.set_num_threads(1)
    for run in plan:
        where = out / run["name"]
        if run["kind"] == "trainer":
            trainer_run(where, run["flags"], run.get("config", {}), run.get("guarded", True))
        else:
            accelerate_run(where, run["guarded"], run.get("inject", []))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
