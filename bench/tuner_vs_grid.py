"""The tuner against an exhaustive grid over the same small CPU search space.

    python bench/tuner_vs_grid.py                       # default space, 2 minute tuning budget
    python bench/tuner_vs_grid.py --budget 90s --space "-all micro_batch=1,2,4,8 fused_adamw=on,off"

Grid: every configuration of the space in a fresh trainer process
(`python -m trainer`), `--warmup` steps discarded then `--steps` steps
measured; its throughput is the median of the per-step tokens/s, its cost the
process's whole wall time (start-up included, as a user running the grid by
hand would pay it).

Tuner: `gptop --no-ui tune --tune-only --tune-space SPACE --budget B` from the
same starting configuration, with a fresh study (so nothing is warm-started),
timed from launch to exit (start-up, trials, restarts, report).

Reported: the share of the grid's best throughput that the tuner reached --
the configuration the tuner picked against the grid's best, both judged by
the grid's measurement protocol -- and the share of the grid's time the tuner
used. Because a shared machine drifts over the minutes a grid takes, the
grid's top configurations and the tuner's pick are then measured again,
alternately (`--confirm` rounds), and the share is also given from those
paired measurements (medians), which is the number to quote. Results go to
stdout (markdown) and, with --json, to a file.

Both measure on a shared machine: run it when the machine is otherwise idle,
and read the grid's spread column before trusting a difference of a few
percent. One trainer thread by default (--threads), which makes CPU timings
far steadier on small machines.
"""

from __future__ import annotations

import argparse
import dataclasses
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

DEFAULT_SPACE = "-all micro_batch=1,2,4,8 prefetch=0,2 fused_adamw=on,off attention=sdpa,eager"
SETUP = [
    "--model",
    "llama",
    "--size",
    "tiny",
    "--seq-len",
    "64",
    "--global-batch",
    "8",
    "--warmup-steps",
    "2",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "0",
    "--device",
    "cpu",
]
START = ["--micro-batch", "1", "--attention", "eager", "--prefetch", "0"]


def toggles_argv(t: dict) -> list[str]:
    out = [
        "--micro-batch",
        str(t["micro_batch"]),
        "--prefetch",
        str(t["prefetch"]),
        "--workers",
        str(t["workers"]),
        "--attention",
        t["attention"],
        "--precision",
        t["precision"],
        "--compile",
        t["compile"],
        "--fused-adamw" if t["fused_adamw"] else "--no-fused-adamw",
        "--activation-checkpointing" if t["activation_checkpointing"] else "--no-activation-checkpointing",
    ]
    return out


def space_configs(spec: str, start_argv: list[str]) -> list[dict]:
    from trainer.contract.config import TrainConfig, add_arguments, config_from_args
    from trainer.device_probe import detect
    from tuner.space import SearchSpace

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg: TrainConfig = config_from_args(p.parse_args(SETUP + start_argv))
    space = SearchSpace.for_device(cfg.toggles, detect("cpu"), cfg.optim.global_batch, spec=spec)
    return [dataclasses.asdict(space.to_toggles(params)) for params in space.all_params()]


def measure(toggles: dict, steps: int, warmup: int, env: dict, work: Path) -> dict:
    from trainer.contract.events import StepEvent, read_events

    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="grid-"))
    argv = [
        sys.executable,
        "-m",
        "trainer",
        *SETUP,
        *toggles_argv(toggles),
        "--max-steps",
        str(warmup + steps),
        "--log-every",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        return {"toggles": toggles, "tokens_per_s": None, "wall_s": wall, "error": p.stderr.strip()[-300:]}
    tps = [
        e.tokens_per_s
        for e in read_events(run_dir / "events.jsonl")
        if isinstance(e, StepEvent) and e.step > warmup and e.tokens_per_s
    ]
    q = statistics.quantiles(tps, n=4) if len(tps) >= 4 else [min(tps), 0, max(tps)]
    return {"toggles": toggles, "tokens_per_s": statistics.median(tps), "iqr": [q[0], q[2]], "wall_s": wall}


def run_tuner(spec: str, budget: str, start_argv: list[str], env: dict, work: Path) -> dict:
    run_dir = work / "tune"
    storage = f"sqlite:///{work / 'study.sqlite3'}"
    argv = [
        sys.executable,
        "-m",
        "gptop",
        "--no-ui",
        "tune",
        "--tune-only",
        "--budget",
        budget,
        "--tune-space",
        spec,
        "--storage",
        storage,
        *SETUP,
        *start_argv,
        "--max-steps",
        "100000",
        "--log-every",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"gptop tune failed ({p.returncode}):\n{p.stderr[-2000:]}\n{p.stdout[-2000:]}")
    report = json.loads((run_dir / "tuning.json").read_text())
    this = [t for t in report["trials"] if t["run"] == "this"]
    return {
        "wall_s": wall,
        "best": report["best"],
        "best_tokens_per_s": report["best_tokens_per_s"],
        "trials": len([t for t in this if t.get("duration_s")]),
        "applied": report["applied"],
        "outcome": report["outcome"],
    }


def key(t: dict) -> str:
    return json.dumps(t, sort_keys=True)


def diff(t: dict, base: dict) -> str:
    d = [f"{k}={'on' if v is True else 'off' if v is False else v}" for k, v in t.items() if base.get(k) != v]
    return ", ".join(d) or "(start)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--space", default=DEFAULT_SPACE, help=f"--tune-space for both (default: {DEFAULT_SPACE!r})")
    ap.add_argument("--budget", default="2m", help="the tuner's budget (default: 2m)")
    ap.add_argument("--steps", type=int, default=30, help="grid: measured steps per configuration (default: 30)")
    ap.add_argument("--warmup", type=int, default=5, help="grid: discarded steps per configuration (default: 5)")
    ap.add_argument("--threads", default="1", help="OMP_NUM_THREADS for the trainers (default: 1)")
    ap.add_argument(
        "--confirm",
        type=int,
        default=3,
        help="rounds re-measuring the grid's top 3 and the tuner's pick alternately (default: 3)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)

    env = dict(os.environ, OMP_NUM_THREADS=args.threads, PYTHONPATH=str(ROOT))
    work = Path(tempfile.mkdtemp(prefix="tuner-vs-grid-"))
    configs = space_configs(args.space, START)
    from trainer.contract.config import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    start = dataclasses.asdict(config_from_args(p.parse_args(SETUP + START)).toggles)
    print(
        f"grid: {len(configs)} configurations x ({args.warmup} + {args.steps}) steps, each in a fresh process",
        flush=True,
    )
    grid = []
    for i, t in enumerate(configs, 1):
        r = measure(t, args.steps, args.warmup, env, work)
        grid.append(r)
        print(
            f"  {i:2d}/{len(configs)} {diff(t, start):55s} {(r['tokens_per_s'] or 0):8.0f} tok/s  {r['wall_s']:5.1f} s",
            flush=True,
        )
    grid_s = sum(r["wall_s"] for r in grid)
    ok = [r for r in grid if r["tokens_per_s"]]
    best = max(ok, key=lambda r: r["tokens_per_s"])
    print(f"tuner: gptop tune --tune-only --budget {args.budget}", flush=True)
    tuner = run_tuner(args.space, args.budget, START, env, work)
    by_key = {key(r["toggles"]): r for r in grid}
    picked = by_key.get(key(tuner["best"]))
    reached = picked["tokens_per_s"] / best["tokens_per_s"] if picked and picked["tokens_per_s"] else None
    ranked = sorted(ok, key=lambda r: -r["tokens_per_s"])
    rank = next((i + 1 for i, r in enumerate(ranked) if key(r["toggles"]) == key(tuner["best"])), None)
    # Confirmation: the grid's top 3 and the tuner's pick again, alternately, so drift hits all alike.
    contenders = {key(r["toggles"]): r["toggles"] for r in ranked[:3]}
    contenders.setdefault(key(tuner["best"]), tuner["best"])
    again: dict[str, list[float]] = {k: [] for k in contenders}
    for rnd in range(args.confirm):
        for k, t in contenders.items():
            r = measure(t, args.steps, args.warmup, env, work)
            if r["tokens_per_s"]:
                again[k].append(r["tokens_per_s"])
        print(
            f"  confirmation round {rnd + 1}/{args.confirm}: "
            + ", ".join(f"{diff(contenders[k], start) or '(start)'} {v[-1]:.0f}" for k, v in again.items() if v),
            flush=True,
        )
    confirmed = {k: statistics.median(v) for k, v in again.items() if v}
    confirmed_share = None
    if confirmed and key(tuner["best"]) in confirmed:
        confirmed_share = confirmed[key(tuner["best"])] / max(confirmed.values())
    result = {
        "space": args.space,
        "configurations": len(configs),
        "start": start,
        "budget": args.budget,
        "grid": {"wall_s": grid_s, "best": best["toggles"], "best_tokens_per_s": best["tokens_per_s"], "results": grid},
        "tuner": tuner
        | {"grid_tokens_per_s_of_pick": picked["tokens_per_s"] if picked else None, "rank_in_grid": rank},
        "share_of_best_throughput": reached,
        "share_of_grid_time": tuner["wall_s"] / grid_s,
        "confirmation": {
            "rounds": args.confirm,
            "tokens_per_s": [{"toggles": contenders[k], "runs": again[k]} for k in contenders],
            "share_of_best_throughput": confirmed_share,
        },
        "start_tokens_per_s": by_key.get(key(start), {}).get("tokens_per_s"),
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "threads": args.threads},
    }
    print()
    print("| | grid | tuner |")
    print("|---|---|---|")
    print(f"| configurations measured | {len(configs)} | {tuner['trials']} |")
    print(
        f"| wall time | {grid_s:.0f} s | {tuner['wall_s']:.0f} s ({result['share_of_grid_time']:.0%} of the grid's) |"
    )
    print(
        f"| best found | {diff(best['toggles'], start)}: {best['tokens_per_s']:.0f} tok/s | "
        f"{diff(tuner['best'], start)}: {(picked or {}).get('tokens_per_s') or 0:.0f} tok/s in the grid "
        f"(rank {rank}/{len(ok)}; tuner's estimate {tuner['best_tokens_per_s'] or 0:.0f}) |"
    )
    print(
        f"| share of the grid's best throughput | 100% | {reached:.0%} |"
        if reached is not None
        else "| share of the grid's best throughput | 100% | n/a |"
    )
    if confirmed_share is not None:
        print(
            f"| same, re-measured alternately with the grid's top 3 ({args.confirm} rounds, medians) | "
            f"{max(confirmed.values()):.0f} tok/s | {confirmed_share:.0%} |"
        )
    print(
        f"\nstart ({diff(start, start)}): {result['start_tokens_per_s'] or 0:.0f} tok/s in the grid; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
