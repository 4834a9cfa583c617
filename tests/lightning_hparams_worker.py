"""One Lightning run in one process (tests/test_integration_lightning.py): examples/lightning's module
with a hyperparameter ``torch.load(weights_only=True)`` refuses (a ``pathlib.Path``, stored by
``save_hyperparameters()``), ``accumulate_grad_batches=1``, a checkpoint every epoch.

    python tests/lightning_hparams_worker.py OUT EPOCHS [CKPT]

With CKPT: ``trainer.fit(ckpt_path=CKPT, weights_only=False)`` (the strategy checks the file's
bytes against its manifest before Lightning unpickles it). Writes ``OUT/result.json``: the final
global_step and weight digest.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import sdcguard  # noqa: E402
from data import RandomData  # noqa: E402
from model import TinyClassifier  # noqa: E402
from sdcguard.fingerprint import digest, fingerprint  # noqa: E402
from sdcguard.integrations.lightning import GuardedDDPStrategy  # noqa: E402


class WithDataDir(TinyClassifier):
    def __init__(self, data_dir: Path, lr: float = 1e-2) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def main() -> None:
    out, epochs, resume = Path(sys.argv[1]), int(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else None)
    torch.set_num_threads(1)
    L.seed_everything(7)
    model = WithDataDir(out / "data")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=GuardedDDPStrategy(sdcguard.Config()),
                        max_epochs=epochs, limit_train_batches=4, gradient_clip_val=1.0,
                        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_top_k=-1)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    trainer.fit(model, datamodule=RandomData(32, 4), ckpt_path=resume, weights_only=False if resume else None)
    (out / "result.json").write_text(json.dumps({
        "global_step": trainer.global_step,
        "weights_digest": digest(fingerprint(p.detach()) for p in model.parameters()).hex()}))


if __name__ == "__main__":
    main()
