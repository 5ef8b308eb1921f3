"""What gptop's probe (gptop.integrations.torch.Probe) costs a plain loop, outside gptop and under it, in its two
forms against no probe at all.

Three variants of each loop, timed in the same process, alternating in rounds (each round in another order,
so machine drift hits all alike), medians over the rounds:

- none: the loop without a probe (the baseline, measured in the same run);
- explicit: `with probe.step(n)` around the step and a `with probe.phase(...)` around each of its four parts
  (the probe also has the model and the optimizer, so its hooks fire inside the phases and time nothing);
- hooks: one `probe.step(n)` call per step; the hooks on the model's forward and the optimizer's step give the
  phases, and the tokens are counted from the forward's input.

Two loops:

- empty: a step of a forward that does nothing, an optimizer step without gradients and `log` of a tensor:
  the probe's own cost per step (the variant's time less none's), in microseconds;
- train: a step of the examples' tiny Llama (examples/synthetic.py; 8 x 64 tokens, AdamW): each variant's
  step time as a ratio to none's of the same round.

Outside gptop (no GPTOP_CHANNEL) every probe call is a no-op and no hook is installed. For the figures under
gptop the script starts itself again under `gptop --no-ui run` (the probe then connects, times phases, sends
a progress event at most every 50 ms and a step event every 10 steps) and reads that process's figures back.

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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("none", "explicit", "hooks")


def measure(rounds: int, steps: int, empty: int) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gptop.integrations.torch import Probe
    from synthetic import sequences, tiny_llama

    class Called(torch.nn.Module):
        """The module the loop calls: the tiny Llama, or nothing at all (`empty`)."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.llama = tiny_llama(64)
            self.empty = False

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            if self.empty:
                return input_ids
            return self.llama(input_ids=input_ids, labels=labels).loss

    plain, probed = Called(), Called()  # the same weights; only the probed one has the probe's hooks
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(probed.parameters(), lr=1e-3)
    probe = Probe(probed, optimizer=opt)
    g = torch.Generator().manual_seed(0)
    x0 = torch.zeros((1, 1), dtype=torch.long)
    loss0 = torch.zeros(())
    counter = {"step": 0}

    def number() -> int:
        counter["step"] += 1
        return counter["step"]

    def empty_none() -> None:
        for _ in range(empty):
            plain(x0)
            opt_plain.step()

    def empty_explicit() -> None:
        for _ in range(empty):
            with probe.step(number()):
                with probe.phase("data"):
                    pass
                with probe.phase("forward"):
                    probed(x0)
                with probe.phase("backward"):
                    pass
                with probe.phase("optimizer"):
                    opt.step()
                probe.log(loss=loss0)

    def empty_hooks() -> None:
        for _ in range(empty):
            probe.step(number())
            probed(x0)
            opt.step()
            probe.log(loss=loss0)

    def train_none() -> None:
        for _ in range(steps):
            x = sequences(8, 64, g)
            loss = plain(x, x)
            loss.backward()
            opt_plain.step()
            opt_plain.zero_grad(set_to_none=True)

    def train_explicit() -> None:
        for _ in range(steps):
            with probe.step(number()):
                with probe.phase("data"):
                    x = sequences(8, 64, g)
                with probe.phase("forward"):
                    loss = probed(x, x)
                with probe.phase("backward"):
                    loss.backward()
                with probe.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                probe.log(loss=loss)

    def train_hooks() -> None:
        for _ in range(steps):
            probe.step(number())
            x = sequences(8, 64, g)
            loss = probed(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            probe.log(loss=loss)

    loops: dict[str, dict[str, Callable[[], None]]] = {
        "empty": {"none": empty_none, "explicit": empty_explicit, "hooks": empty_hooks},
        "train": {"none": train_none, "explicit": train_explicit, "hooks": train_hooks},
    }
    per = {"empty": empty, "train": steps}

    def timed(loop: str, variant: str) -> float:
        plain.empty = probed.empty = loop == "empty"
        t = time.perf_counter()
        loops[loop][variant]()
        return (time.perf_counter() - t) / per[loop]

    for variant in VARIANTS:  # warm-up: allocator, first-call costs
        timed("train", variant)
    res: dict[str, dict[str, list[float]]] = {loop: {v: [] for v in VARIANTS} for loop in loops}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for loop in loops:
            for variant in order:
                res[loop][variant].append(timed(loop, variant))
    connected = probe.active  # on under gptop, until close
    probe.close()
    med = {loop: {v: statistics.median(res[loop][v]) for v in VARIANTS} for loop in loops}
    ratios = {v: [a / b for a, b in zip(res["train"][v], res["train"]["none"])] for v in VARIANTS[1:]}
    return {
        "connected": connected,
        "own_us": {v: (med["empty"][v] - med["empty"]["none"]) * 1e6 for v in VARIANTS[1:]},
        "train_ms": {v: med["train"][v] * 1e3 for v in VARIANTS},
        "ratio": {v: [statistics.median(rs), min(rs), max(rs)] for v, rs in ratios.items()},
    }


def under_gptop(args: argparse.Namespace) -> dict[str, Any]:
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
    assert not outside["connected"], "GPTOP_CHANNEL is set: run this outside gptop"
    inside = under_gptop(args)
    assert inside["connected"], "the probe did not connect under gptop run"
    print(f"load average at the start {load[0]:.2f}, at the end {os.getloadavg()[0]:.2f}")
    print("| where | probe | its own cost per step | tiny Llama step | ratio to no probe (min-max over rounds) |")
    print("|---|---|---:|---:|---:|")
    for name, r in (("outside gptop", outside), ("under gptop run", inside)):
        print(f"| {name} | none | | {r['train_ms']['none']:.1f} ms | 1 |")
        for v, label in (("explicit", "explicit: `with` step and 4 phases"), ("hooks", "hooks: `probe.step(n)`")):
            med, lo, hi = r["ratio"][v]
            print(
                f"| {name} | {label} | {r['own_us'][v]:.1f} µs | {r['train_ms'][v]:.1f} ms "
                f"| {med:.3f} ({lo:.3f}-{hi:.3f}) |"
            )


if __name__ == "__main__":
    main()
