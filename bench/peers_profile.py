"""Where the time goes in two contenders of bench/peers.py: the operators' self CPU time per step, side by side.

    python bench/peers_profile.py --size small --seq-len 64 --global-batch 4 --steps 20
    python bench/peers_profile.py --contenders hf,gptop --size tiny

Each contender trains the benchmark's setup (bench/peers.py: same model, batches, optimizer settings) in a fresh
subprocess with one torch thread, with torch.profiler recording a window of steady steps (from --skip to the end:
set-up, gptop's micro-batch probe, compilation and the first steps' warm-up stay outside). The table lists the
operators by self CPU time per optimizer step, with the window's wall time per step (the profiler's own cost is
inside it, alike for all). It answers the question peers.py's ratios
leave open: when two contenders differ, which operators make the difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import peers  # noqa: E402  (bench/peers.py: the one definition of the setup and of the HF contenders)

CHOICES = ("plain", "hf", "hf-fast", "gptop")


def profiled(spec: peers.Spec, name: str, first: int, last: int) -> dict:
    """Train one contender, profiling the steps from `first` to `last` (0-based batch indices); their operators'
    self CPU time per step and call counts per step.

    The window opens and closes when the contender asks the benchmark's sampler for those batches (the one hook
    every contender shares); a contender that fetches ahead (HF's dataloader) shifts the window by its look-ahead,
    not its length. gptop runs without prefetch here, so that the window opens in the training thread.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.batches import BatchSampler

    torch.set_num_threads(spec.threads)
    prof = profile(activities=[ProfilerActivity.CPU])
    clock: dict[str, float] = {}
    fetch = BatchSampler.micro_batch

    def watched(self, batch_index: int, micro_index: int, micro_batch: int):
        if micro_index == 0 and batch_index == first and "start" not in clock:
            prof.start()
            clock["start"] = time.perf_counter()
        elif micro_index == 0 and batch_index == last and "start" in clock and "stop" not in clock:
            clock["stop"] = time.perf_counter()
            prof.stop()
        return fetch(self, batch_index, micro_index, micro_batch)

    BatchSampler.micro_batch = watched
    if name == "plain":
        peers.worker_plain(spec)
    elif name in ("hf", "hf-fast"):
        peers.worker_hf(spec, fast=name == "hf-fast")
    else:
        from trainer.worker_cli import main

        with tempfile.TemporaryDirectory(prefix="peers-profile-") as tmp:
            # The sampler is asked from the profiling thread only without prefetch (a profiler started in the
            # prefetch thread records that thread alone); the data phase costs well under 1% of these steps.
            code = main(peers.gptop_argv(spec, Path(tmp) / "run", None)[3:] + ["--prefetch", "0"])
        if code:
            raise SystemExit(f"gptop's trainer exited {code}")
    if "stop" not in clock:
        raise SystemExit(f"{name}: the profile window (batches {first}-{last}) was not reached")
    n = last - first
    ops = [{"op": e.key, "self_us": e.self_cpu_time_total / n, "count": e.count / n} for e in prof.key_averages()]
    return {"wall_s": (clock["stop"] - clock["start"]) / n, "ops": ops}


def table(results: dict[str, dict], top: int) -> list[str]:
    names = list(results)
    per: dict[str, dict[str, float]] = {n: {o["op"]: o["self_us"] / 1000 for o in r["ops"]} for n, r in results.items()}
    ops = sorted({op for d in per.values() for op in d}, key=lambda op: -max(d.get(op, 0.0) for d in per.values()))
    head = "| operator | " + " | ".join(f"{n} ms/step (calls)" for n in names) + " |"
    calls = {n: {o["op"]: o["count"] for o in r["ops"]} for n, r in results.items()}
    lines = [head, "|---|" + "---:|" * len(names)]
    for op in ops[:top]:
        lines.append(
            f"| `{op}` | " + " | ".join(f"{per[n].get(op, 0.0):.1f} ({calls[n].get(op, 0):g})" for n in names) + " |"
        )
    lines.append("| all operators (self) | " + " | ".join(f"{sum(per[n].values()):.1f}" for n in names) + " |")
    lines.append("| wall / step | " + " | ".join(f"{results[n]['wall_s'] * 1000:.1f}" for n in names) + " |")
    return lines


def main() -> None:
    d = peers.Spec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contenders", default="hf,gptop", help=f"comma-separated, of {', '.join(CHOICES)}")
    ap.add_argument("--size", default=d.size, choices=("tiny", "small", "medium"))
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--global-batch", type=int, default=d.global_batch)
    ap.add_argument("--micro-batch", type=int, default=None, help="for plain and HF (default: the global batch)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--skip", type=int, default=5, help="steps before the profiled window")
    ap.add_argument("--top", type=int, default=15, help="operators shown")
    ap.add_argument("--json", metavar="PATH", default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--window", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        spec = peers.Spec(**json.loads(a.spec))
        first, last = (int(x) for x in a.window.split("-"))
        Path(a.out).write_text(json.dumps(profiled(spec, a.worker, first, last)))
        return
    names = [n.strip() for n in a.contenders.split(",") if n.strip()]
    bad = [n for n in names if n not in CHOICES]
    if bad or not names:
        ap.error(f"--contenders: {', '.join(bad) or 'none given'}: choose from {', '.join(CHOICES)}")
    if not 0 <= a.skip < a.steps - 2:
        ap.error(f"--skip {a.skip}: must leave at least 3 of the {a.steps} steps (--steps) to profile")
    spec = peers.Spec(
        size=a.size,
        seq_len=a.seq_len,
        global_batch=a.global_batch,
        micro_batch=a.micro_batch or a.global_batch,
        steps=a.steps,
        warmup=0,
        log_every=min(d.log_every, a.steps),
        threads=1,
    )
    first, last = a.skip, a.steps - 2  # the last batch may never be asked for by a contender without look-ahead
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="peers-profile-") as tmp:
        for n in names:
            out = Path(tmp) / f"{n}.json"
            argv = [
                sys.executable,
                __file__,
                "--worker",
                n,
                "--spec",
                json.dumps(asdict(spec)),
                "--out",
                str(out),
                "--window",
                f"{first}-{last}",
            ]
            p = subprocess.run(argv, cwd=ROOT, env=peers.child_env(spec), capture_output=True, text=True)
            if p.returncode != 0 or not out.is_file():
                sys.exit(f"{n}: exit {p.returncode}\n{p.stderr[-2000:]}")
            results[n] = json.loads(out.read_text())
            print(f"{n}: {results[n]['wall_s'] * 1000:.1f} ms/step in the window", flush=True)
    print(
        f"llama/{a.size}, seq-len {a.seq_len}, global batch {a.global_batch}, batches {first}-{last - 1} profiled, "
        f"1 thread, self CPU time per step:"
    )
    print("\n".join(table(results, a.top)))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "window": [first, last], "results": results}, indent=1))


if __name__ == "__main__":
    main()
