"""MFU that does not depend on how busy the machine was when the peak was measured (issue 10 §5).

The same tiny model trains with one rank and with two ranks (torchrun, gloo), each while another
process loads the CPU (a busy loop at normal priority, started before the trainer so the peak is
measured under load) and while it does not. Every run measures its CPU peak afresh (its own empty
$GPTOP_CACHE), so a run under load measures under load. For each run the table shows the peak per
process the trainer measured (hello.peak_flops), the median tokens/s and MFU of the steady steps, and
the peak the previous method (best wall-clock time of a 1024 matmul with the run's threads) gets under
the same conditions, measured in this script right before the run.

MFU is achieved/peak: under load the achieved rate falls (the trainer shares the cores), so MFU falls
with it; what must not happen is the peak falling with it, which made MFU read 97% before. The
verdict line says whether all MFUs are within 1.5x of each other, and the peaks' spread.

    python bench/mfu.py                  # ~3 min on 2 idle cores (15 min at load average 15)
    python bench/mfu.py --threads 1      # the one-rank run on one thread, as each of two ranks is
    python bench/mfu.py --steps 40 --seq-len 128 --json
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
sys.path.insert(0, str(ROOT))

from trainer.contract.device import cpu_name  # noqa: E402
from trainer.contract.events import HelloEvent, StepEvent, read_events  # noqa: E402

LOAD = "while True: pass"
OLD_PEAK = """
import time, torch
torch.set_num_threads({threads})
n = 1024
a, b = torch.randn(n, n), torch.randn(n, n)
torch.mm(a, b)
best, deadline = 0.0, time.perf_counter() + 0.6
while time.perf_counter() < deadline:
    t = time.perf_counter(); torch.mm(a, b); best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
print(best / {procs})
"""


def old_peak(threads: int, procs: int) -> float:
    """The previous method: best wall-clock rate of a 1024 matmul, the node's share per process."""
    out = subprocess.run(
        [sys.executable, "-c", OLD_PEAK.format(threads=threads, procs=procs)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def run(ranks: int, loaded: bool, args: argparse.Namespace, work: Path) -> dict:
    name = f"{ranks}rank-{'loaded' if loaded else 'idle'}"
    run_dir = work / name
    cache = work / f"cache-{name}"  # a fresh peak cache; the tokens and tokenizers are shared
    cache.mkdir()
    shared = Path(os.environ.get("GPTOP_CACHE") or Path.home() / ".cache" / "gptop").expanduser()
    for sub in ("tokens", "tokenizers"):
        if (shared / sub).is_dir():
            (cache / sub).symlink_to(shared / sub)
    env = dict(os.environ, GPTOP_CACHE=str(cache), PYTHONPATH=str(ROOT))
    if args.threads and ranks == 1:  # torchrun gives each of several ranks one thread
        env["OMP_NUM_THREADS"] = str(args.threads)
    train = [
        "--model",
        args.model,
        "--size",
        "tiny",
        "--seq-len",
        str(args.seq_len),
        "--global-batch",
        str(args.global_batch),
        "--max-steps",
        str(args.steps),
        "--log-every",
        "5",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--warmup-steps",
        "2",
        "--device",
        "cpu",
        "--run-dir",
        str(run_dir),
    ]
    launch = (
        []
        if ranks == 1
        else ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", str(ranks)]
    )
    cmd = [sys.executable, *launch, "-m", "trainer", *train]
    load = subprocess.Popen([sys.executable, "-c", LOAD]) if loaded else None
    try:
        time.sleep(0.5 if loaded else 0.0)
        threads = (args.threads or os.cpu_count() or 1) if ranks == 1 else 1
        legacy = old_peak(threads, ranks)
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        seconds = time.time() - t0
    finally:
        if load is not None:
            load.kill()
            load.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: trainer exited {proc.returncode}\n{proc.stderr[-2000:]}")
    events = list(read_events(run_dir / "events.jsonl"))
    hello = next(
        e for e in events if isinstance(e, HelloEvent) and not e.early
    )  # the full hello (the early one has no peak)
    steps = [e for e in events if isinstance(e, StepEvent) and e.rank == 0][1:]  # the first interval warms up
    mfus = [e.mfu for e in steps if e.mfu is not None]
    tps = [e.tokens_per_s for e in steps if e.tokens_per_s is not None]
    return {
        "run": name,
        "ranks": ranks,
        "loaded": loaded,
        "peak_flops": hello.peak_flops,
        "peak_source": hello.peak_source,
        "old_method_peak_flops": legacy,
        "tokens_per_s": statistics.median(tps) if tps else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "seconds": round(seconds, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--model", default="llama")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads of the one-rank run (default: torch's, one per core)"
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gptop-mfu-") as d:
        rows = [run(ranks, loaded, args, Path(d)) for ranks in (1, 2) for loaded in (False, True)]
    mfus = [r["mfu"] for r in rows if r["mfu"]]
    per_rank = {r["ranks"]: [x["peak_flops"] for x in rows if x["ranks"] == r["ranks"]] for r in rows}
    olds = {r["ranks"]: [x["old_method_peak_flops"] for x in rows if x["ranks"] == r["ranks"]] for r in rows}
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "one_rank_threads": args.threads or "torch default",
        "loadavg_before": [round(x, 2) for x in load_before],
        "rows": rows,
        "mfu_ratio_max_min": max(mfus) / min(mfus) if len(mfus) == len(rows) else None,
        "peak_ratio_loaded_idle": {k: v[1] / v[0] for k, v in per_rank.items() if v[0] and v[1]},
        "old_method_ratio_loaded_idle": {k: v[1] / v[0] for k, v in olds.items() if v[0] and v[1]},
    }
    summary["within_1_5x"] = summary["mfu_ratio_max_min"] is not None and summary["mfu_ratio_max_min"] <= 1.5
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"{summary['date']} · {summary['cpu']} · {summary['cores']} cores · load average before "
        f"{' '.join(map(str, summary['loadavg_before']))} · one-rank threads: {summary['one_rank_threads']}"
    )
    print(f"{'run':<14} {'peak/proc GFLOP/s':>18} {'old method':>11} {'tokens/s':>9} {'MFU':>7} {'time':>6}")
    for r in rows:
        print(
            f"{r['run']:<14} {r['peak_flops'] / 1e9:>18.1f} {r['old_method_peak_flops'] / 1e9:>11.1f} "
            f"{r['tokens_per_s'] or 0:>9.0f} {(r['mfu'] or 0) * 100:>6.2f}% {r['seconds']:>5.0f}s"
        )
    for k, v in summary["peak_ratio_loaded_idle"].items():
        print(
            f"{k} rank(s): peak loaded/idle {v:.2f} (old method {summary['old_method_ratio_loaded_idle'].get(k, 0):.2f})"
        )
    ratio = summary["mfu_ratio_max_min"]
    print(
        f"MFU max/min over the four runs: {ratio:.2f} -> {'within' if summary['within_1_5x'] else 'NOT within'} 1.5x"
        if ratio
        else "MFU missing in a run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
