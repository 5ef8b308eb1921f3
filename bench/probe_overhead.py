"""What gptop's probe (gptop.integrations.torch.Probe) costs a plain loop, outside gptop and under it.

Two loops, each timed with and without the probe in the same process, alternating in rounds (so machine
drift hits both alike), medians over the rounds:

- empty: a step that does nothing but the probe's calls (`step`, four `phase`s, `log` of a tensor): the
  probe's own cost per step, in microseconds;
- train: a step of the examples' tiny Llama (examples/synthetic.py; 8 x 64 tokens, AdamW): the ratio of a
  step's time with the probe to without it.

Outside gptop (no GPTOP_CHANNEL) every probe call is a no-op. For the figures under gptop the script starts
itself again under `gptop --no-ui run` (the probe then connects, times phases, sends a progress event every
step and a step event every 10) and reads that process's figures back.

    OMP_NUM_THREADS=1 python bench/probe_overhead.py [--rounds 7] [--steps 30] [--empty 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(rounds: int, steps: int, empty: int) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gptop.integrations.torch import Probe
    from synthetic import sequences, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    probe = Probe(model, tokens_per_step=8 * 64, optimizer=opt)
    loss0 = torch.zeros(())
    counter = {"step": 0}

    def empty_plain() -> None:
        for _ in range(empty):
            pass

    def empty_probe() -> None:
        for _ in range(empty):
            counter["step"] += 1
            with probe.step(counter["step"]):
                with probe.phase("data"):
                    pass
                with probe.phase("forward"):
                    pass
                with probe.phase("backward"):
                    pass
                with probe.phase("optimizer"):
                    pass
                probe.log(loss=loss0)

    def train_step() -> None:
        x = sequences(8, 64, g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def train_plain() -> None:
        for _ in range(steps):
            train_step()

    def train_probe() -> None:
        for _ in range(steps):
            counter["step"] += 1
            with probe.step(counter["step"]):
                with probe.phase("data"):
                    x = sequences(8, 64, g)
                with probe.phase("forward"):
                    loss = model(input_ids=x, labels=x).loss
                with probe.phase("backward"):
                    loss.backward()
                with probe.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                probe.log(loss=loss)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    train_plain()  # warm-up: allocator, first-call costs
    train_probe()
    res: dict[str, list[float]] = {"empty_plain": [], "empty_probe": [], "train_plain": [], "train_probe": []}
    ratios = []
    for _ in range(rounds):
        res["empty_plain"].append(timed(empty_plain) / empty)
        res["empty_probe"].append(timed(empty_probe) / empty)
        a, b = timed(train_plain) / steps, timed(train_probe) / steps
        res["train_plain"].append(a)
        res["train_probe"].append(b)
        ratios.append(b / a)
    probe.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "active": probe.active,
        "probe_us_per_step": (med["empty_probe"] - med["empty_plain"]) * 1e6,
        "train_plain_ms": med["train_plain"] * 1e3,
        "train_probe_ms": med["train_probe"] * 1e3,
        "train_ratio": statistics.median(ratios),
        "train_ratio_min": min(ratios),
        "train_ratio_max": max(ratios),
    }


def under_gptop(args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        argv = [
            sys.executable,
            "-m",
            "gptop",
            "--no-ui",
            "run",
            "--run-dir",
            str(Path(d) / "run"),
            "--",
            sys.executable,
            __file__,
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--empty",
            str(args.empty),
            "--result",
            str(out),
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30, help="training steps per round and variant")
    ap.add_argument("--empty", type=int, default=5000, help="empty steps per round and variant")
    ap.add_argument("--result", help=argparse.SUPPRESS)  # the run under gptop writes its figures here
    args = ap.parse_args()
    if args.result:
        Path(args.result).write_text(json.dumps(measure(args.rounds, args.steps, args.empty)))
        return
    load = os.getloadavg()
    outside = measure(args.rounds, args.steps, args.empty)
    assert not outside["active"], "GPTOP_CHANNEL is set: run this outside gptop"
    inside = under_gptop(args)
    assert inside["active"], "the probe did not connect under gptop run"
    print(f"load average at the start {load[0]:.2f}, at the end {os.getloadavg()[0]:.2f}")
    print("| where | probe's own cost per step | tiny Llama step without / with the probe | ratio (min-max) |")
    print("|---|---:|---:|---:|")
    for name, r in (("outside gptop", outside), ("under gptop run", inside)):
        print(
            f"| {name} | {r['probe_us_per_step']:.2f} µs | {r['train_plain_ms']:.1f} / {r['train_probe_ms']:.1f} ms "
            f"| {r['train_ratio']:.3f} ({r['train_ratio_min']:.3f}-{r['train_ratio_max']:.3f}) |"
        )


if __name__ == "__main__":
    main()
