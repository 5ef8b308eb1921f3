"""What switching the optimizer on a live run costs: time and the moments' rounding.

A trial of the tuner that switches AdamW to torchao's 8-bit / 4-bit AdamW resumes from the pre-trial
checkpoint and converts the moments (`trainer.optim.convert_state`: dequantize to fp32, store as the new
optimizer stores them). This measures, on matrices of `--params` parameters in all (1024x1024 blocks, as
a model's linear layers; AdamW state after `--steps` real steps on random data):

- the time to load the optimizer state into a new optimizer of the same kind (plain resume) and into
  each other kind (conversion), the conversion as a ratio against the plain load in the same run;
- the rounding: the largest absolute error of each moment after the conversion, relative to that
  tensor's largest magnitude (block-wise quantization bounds it by the block's scale), and after a round
  trip back to fp32 AdamW (which adds nothing: fp32 holds the codes' values exactly).

    python bench/optimizer_switch.py [--params 16] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=16, help="millions of parameters (1024x1024 matrices)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import os

    import torch

    from trainer import optim
    from trainer.contract.device import cpu_name
    from trainer.models import quiet_imports

    with quiet_imports():
        from torchao.optim import AdamW4bit, AdamW8bit

    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(max(1, args.params)))
    params = list(model.parameters())
    adamw = torch.optim.AdamW(params, lr=1e-3, betas=optim.BETAS, eps=optim.EPS, fused=True)
    for _ in range(args.steps):
        for p in params:
            p.grad = torch.randn_like(p)
        adamw.step()
    buf = io.BytesIO()
    torch.save(adamw.state_dict(), buf)
    blob = buf.getvalue()
    ref = {i: {k: adamw.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for i, p in enumerate(params)}

    def make(name: str) -> torch.optim.Optimizer:
        kw = dict(lr=1e-3, betas=optim.BETAS, eps=optim.EPS)
        if name == "adamw":
            return torch.optim.AdamW(params, fused=True, **kw)
        return (AdamW8bit if name == "adamw-8bit" else AdamW4bit)(params, **kw)

    def load(name: str) -> tuple[float, torch.optim.Optimizer]:
        t0 = time.perf_counter()
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        opt = make(name)
        if name == "adamw":
            opt.load_state_dict(saved)
        else:
            optim.convert_state(opt, saved, "adamw", name)
        return time.perf_counter() - t0, opt

    def worst(opt: torch.optim.Optimizer, key: str) -> float:
        return max(
            float((optim.dense(opt.state[p][key]) - ref[i][key]).abs().max() / ref[i][key].abs().max())
            for i, p in enumerate(params)
        )

    times: dict[str, list[float]] = {"adamw": [], "adamw-8bit": [], "adamw-4bit": []}
    errors: dict[str, tuple[float, float, float]] = {}
    for _ in range(args.rounds):
        for name in times:
            dt, opt = load(name)
            times[name].append(dt)
            if name != "adamw" and name not in errors:
                back = make("adamw")
                optim.convert_state(back, opt.state_dict(), name, "adamw")
                errors[name] = (
                    worst(opt, "exp_avg"),
                    worst(opt, "exp_avg_sq"),
                    max(worst(back, "exp_avg"), worst(back, "exp_avg_sq"))
                    - max(worst(opt, "exp_avg"), worst(opt, "exp_avg_sq")),
                )
    base = statistics.median(times["adamw"])
    n = sum(p.numel() for p in params)
    print(
        f"# optimizer switch: {n / 1e6:.1f}M parameters, AdamW state after {args.steps} steps, "
        f"{args.rounds} rounds, {cpu_name()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print("| into | load time | vs plain resume | max error exp_avg | max error exp_avg_sq | round trip adds |")
    print("|---|---|---|---|---|---|")
    for name, ts in times.items():
        t = statistics.median(ts)
        e = errors.get(name)
        err = f"{e[0]:.2%} | {e[1]:.2%} | {max(e[2], 0.0):.2%}" if e else "0 (same format) | 0 | -"
        print(f"| {name} | {t * 1000:.0f} ms | {t / base:.2f}x | {err} |")


if __name__ == "__main__":
    main()
