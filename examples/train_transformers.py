"""A transformers.Trainer script with gptop's callback: `gptop run -- python examples/train_transformers.py`.

A tiny Llama learns a synthetic language from a Dataset held in memory (examples/synthetic.py), so the script
runs offline on a CPU in seconds. The three gptop lines are `tuned_args`, `callbacks=[GptopCallback()]` and
`resume_checkpoint`; without gptop they change nothing.
"""

from __future__ import annotations

import argparse

import torch
from transformers import Trainer, TrainingArguments

from gptop.integrations.transformers import GptopCallback, resume_checkpoint, tuned_args
from synthetic import SyntheticText, tiny_llama  # examples/synthetic.py: the data and the model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per device and step (default: 8)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    ap.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps (default: 1)")
    ap.add_argument("--out", default="checkpoints-hf", help="output_dir (default: checkpoints-hf)")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda when there is one)",
    )
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TrainingArguments.bf16)")
    args = ap.parse_args()

    model = tiny_llama(args.seq_len)
    training = tuned_args(
        TrainingArguments(
            output_dir=args.out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accumulation,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            logging_steps=10,
            save_steps=1000,
            report_to="none",
            use_cpu=args.device == "cpu",
            bf16=args.bf16,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
    )
    trainer = Trainer(
        model=model,
        args=training,
        callbacks=[GptopCallback()],
        train_dataset=SyntheticText(args.steps * args.batch * args.accumulation, args.seq_len),
    )
    result = trainer.train(resume_from_checkpoint=resume_checkpoint(training))
    print(f"trained to step {trainer.state.global_step}; mean loss {result.training_loss:.3f}", flush=True)


if __name__ == "__main__":
    main()
