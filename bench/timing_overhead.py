"""Overhead of phase timing: tokens/s with timing on vs `--no-timing`, measured in one run.

Runs the trainer alternately with and without timing (so machine drift hits
both alike), takes the median steady-state tokens/s of each run (the first log
interval, which holds warm-up, is dropped) and reports the ratio.

    python bench/timing_overhead.py [--rounds 3] [--steps 60] [trainer flags...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(extra: list[str], timing: bool, steps: int, log_every: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        argv = [
            sys.executable,
            "-m",
            "trainer",
            "--run-dir",
            d,
            "--max-steps",
            str(steps),
            "--log-every",
            str(log_every),
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            *extra,
        ]
        argv.append("--timing" if timing else "--no-timing")
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        steps_ev = [json.loads(line) for line in (Path(d) / "events.jsonl").read_text().splitlines()]
        tps = [e["tokens_per_s"] for e in steps_ev if e["type"] == "step"][1:]
        return statistics.median(tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    args, extra = ap.parse_known_args()
    if not extra:
        extra = ["--model", "llama", "--size", "tiny", "--micro-batch", "8", "--global-batch", "16", "--seq-len", "128"]
    on, off = [], []
    for r in range(args.rounds):
        on.append(run_once(extra, True, args.steps, args.log_every))
        off.append(run_once(extra, False, args.steps, args.log_every))
        print(f"round {r + 1}: timing on {on[-1]:.0f} tok/s, off {off[-1]:.0f} tok/s", flush=True)
    ratio = statistics.median(on) / statistics.median(off)
    print(f"trainer flags: {' '.join(extra)}")
    print(f"median tokens/s: timing on {statistics.median(on):.0f}, off {statistics.median(off):.0f}")
    print(f"ratio on/off: {ratio:.4f} ({(1 - ratio) * 100:+.2f}% overhead)")


if __name__ == "__main__":
    main()
