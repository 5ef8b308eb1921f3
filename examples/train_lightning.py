"""A Lightning script with gptop's callback: `gptop run -- python examples/train_lightning.py`.

Needs Lightning (`pip install 'gptop[lightning]'`). A tiny Llama learns a synthetic language from a Dataset
held in memory (examples/synthetic.py), so the script runs offline on a CPU in seconds. The gptop line is
`callbacks=[GptopCallback()]`; without gptop it changes nothing.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

from gptop.integrations.lightning import GptopCallback
from synthetic import SyntheticText, tiny_llama  # examples/synthetic.py: the data and the model


class CausalLM(L.LightningModule):
    def __init__(self, seq_len: int, lr: float):
        super().__init__()
        self.model = tiny_llama(seq_len)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    ap.add_argument("--out", default="lightning-run", help="default_root_dir (default: lightning-run)")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda when there is one)",
    )
    args = ap.parse_args()

    data = DataLoader(SyntheticText(args.steps * args.batch, args.seq_len), batch_size=args.batch)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        default_root_dir=args.out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
        callbacks=[GptopCallback()],
    )
    trainer.fit(CausalLM(args.seq_len, lr=3e-3), train_dataloaders=data)
    print(f"trained to step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
