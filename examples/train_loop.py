"""A plain PyTorch training loop with gptop's probe: `gptop run -- python examples/train_loop.py`.

A tiny Llama learns a synthetic language held in memory (examples/synthetic.py), so it runs offline on a CPU
in seconds, and its loss falls. Without gptop it trains the same: every probe call is a no-op.

It saves its own checkpoints (`--out DIR/step-N.pt`: model, optimizer and step) when gptop asks for one
(the `c` key), when gptop stops it (q, Ctrl-C, SIGTERM, gptop gone) and at the end; `--resume` continues
from the newest one in `--out`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gptop.integrations.torch import Probe
from synthetic import sequences, tiny_llama  # examples/synthetic.py: the data and the model


def batches(batch: int, seq_len: int, seed: int):
    """Batches of the synthetic language, endlessly (a resumed run draws from its own seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield sequences(batch, seq_len, g)


def newest_checkpoint(out: Path) -> Path | None:
    found = sorted(out.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    ap.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds to wait in each data phase, to watch a slow input pipeline (default: 0)",
    )
    ap.add_argument("--out", default="checkpoints-loop", help="checkpoint directory (default: checkpoints-loop)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when there is one, else cpu)",
    )
    args = ap.parse_args()

    model = tiny_llama(args.seq_len).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    out = Path(args.out)
    start = 0
    if args.resume and (ckpt := newest_checkpoint(out)) is not None:
        state = torch.load(ckpt, map_location=args.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed from {ckpt} at step {start}", flush=True)

    def save(step: int) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"step-{step}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, path)
        return path

    if start >= args.steps:
        print(f"{ckpt} is at step {start}, already --steps {args.steps}: nothing to train", flush=True)
        return
    # hooks on the model's forward and the optimizer's step give the breakdown; the tokens and the sequence
    # length come from the forwards' input_ids
    probe = Probe(model, optimizer=opt, max_steps=args.steps)
    data = batches(args.batch, args.seq_len, seed=start)
    for done in range(start, args.steps):
        probe.step(done + 1)  # step done + 1 begins here, the one before ends
        if probe.should_checkpoint or probe.should_stop:
            probe.checkpointed(save(done))
        if probe.should_stop:
            print(f"stopped at step {done}", flush=True)
            break
        x = next(data).to(args.device, non_blocking=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)  # before the step's forward: the probe counts it as data
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # before the optimizer: backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        probe.log(loss=loss, grad_norm=norm)  # tensors: read back only at gptop's log steps
    else:
        probe.checkpointed(save(args.steps))  # after the last step, which ends here
        print(f"trained to step {args.steps}; final loss {loss.item():.3f}", flush=True)
    probe.close()


if __name__ == "__main__":
    main()
