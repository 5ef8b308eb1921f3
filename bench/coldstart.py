"""Cold start: how long from `gptop train` to the first training step, and from a checkpoint to the
first step after a restart (what every tuning trial and the final switch pay).

For each scenario the time is taken from just before gptop is spawned to the `time` of the trainer's
events (`hello`: the trainer is set up; the first `step` event, with --log-every 1: one step done), to gptop's
exit, and the CPU time gptop and its trainer used (user + system, what a loaded machine pays per start):

  train            gptop --no-ui train ... --max-steps 2           (fresh run)
  resume           gptop --no-ui train --resume RUN ...            (restart from the run's checkpoint)
  train+compile    the same with --compile default, compile caches cold (empty inductor cache dir)
  resume+compile   restart with --compile default, caches as the first compiled run left them
  export           gptop export RUN OUT of the fresh run (a tool: torch and transformers, no training)

Repeats alternate the scenarios (and the checkouts, with several `--root`); medians and ranges are
printed. `--root DIR` runs another checkout (e.g. `git archive` of an older commit) to measure "before":

    python bench/coldstart.py [--repeats 3] [--root DIR ...] [--no-compile] [trainer flags...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUP = [
    "--model",
    "llama",
    "--size",
    "tiny",
    "--seq-len",
    "128",
    "--global-batch",
    "16",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--checkpoint-every",
    "0",
    "--device",
    "cpu",
]


def _events(run_dir: Path) -> list[dict]:
    p = run_dir / "events.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def launch(
    root: Path, args: list[str], env: dict[str, str], log: Path, run_dir: Path, after: float = 0.0
) -> dict[str, float | None]:
    """Spawn gptop; seconds from spawn to the first hello and first step event newer than `after`, to its exit,
    and the CPU seconds it and its trainer used."""
    cpu0 = _children_cpu()
    t0 = time.time()
    with open(log, "ab") as fh:
        code = subprocess.run(
            [sys.executable, "-m", "gptop", "--no-ui", "train", *args],
            cwd=root,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        ).returncode
    evs = [e for e in _events(run_dir) if e.get("time", 0) >= max(after, t0 - 1)]
    hello = next((e["time"] for e in evs if e.get("type") == "hello"), None)
    step = next((e["time"] for e in evs if e.get("type") == "step"), None)
    return {
        "code": code,
        "hello": hello - t0 if hello else None,
        "first_step": step - t0 if step else None,
        "total": time.time() - t0,
        "cpu": _children_cpu() - cpu0,
    }


def export(root: Path, env: dict[str, str], log: Path, run_dir: Path, out: Path) -> dict[str, float | None]:
    """`gptop export RUN OUT`: seconds to its exit and the CPU it and its tool used (no events to time)."""
    cpu0 = _children_cpu()
    t0 = time.time()
    with open(log, "ab") as fh:
        code = subprocess.run(
            [sys.executable, "-m", "gptop", "export", str(run_dir), str(out)],
            cwd=root,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        ).returncode
    return {"code": code, "hello": None, "first_step": None, "total": time.time() - t0, "cpu": _children_cpu() - cpu0}


def _children_cpu() -> float:
    """User + system seconds of every child waited for so far, their own waited children included."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _median_range(xs: list[float | None]) -> str:
    vals = [x for x in xs if x is not None]
    if not vals or len(vals) < len(xs):
        return "-"  # not timed in this scenario (an export has no hello or step)
    return f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--root",
        action="append",
        default=None,
        help="checkout to run (default: this one); repeat the flag to alternate several",
    )
    ap.add_argument("--no-compile", action="store_true", help="skip the --compile default scenarios")
    ap.add_argument("--threads", type=int, default=0)
    args, extra = ap.parse_known_args()
    roots = [Path(r).resolve() for r in (args.root or [str(ROOT)])]
    setup = SETUP + extra
    work = Path(tempfile.mkdtemp(prefix="gptop-coldstart-"))
    scen = ["train", "resume", "export"] + ([] if args.no_compile else ["train+compile", "resume+compile"])
    res: dict[tuple[int, str], list[dict]] = {(i, s): [] for i in range(len(roots)) for s in scen}
    print(f"setup {' '.join(setup)}", flush=True)
    for i, root in enumerate(roots):
        print(f"root {i}: {root}", flush=True)
    order = [
        (rep, ri, compiled)
        for rep in range(args.repeats)
        for ri in range(len(roots))
        for compiled in ([False] if args.no_compile else [False, True])
    ]
    for rep, ri, compiled in order:
        env = dict(os.environ, PYTHONPATH=str(roots[ri]))
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        tag = "+compile" if compiled else ""
        flags = setup + (["--compile", "default"] if compiled else [])
        if compiled:
            cache = work / f"inductor-{ri}-{rep}"  # cold: an empty inductor cache for this run
            shutil.rmtree(cache, ignore_errors=True)
            env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        run_dir = work / f"run{tag}-{ri}-{rep}"
        log = work / f"run{tag}-{ri}-{rep}.log"
        r = launch(roots[ri], flags + ["--max-steps", "2", "--run-dir", str(run_dir)], env, log, run_dir)
        res[(ri, "train" + tag)].append(r)
        t_after = time.time()
        r2 = launch(
            roots[ri],
            ["--resume", str(run_dir), "--max-steps", "4", "--log-every", "1"],
            env,
            log,
            run_dir,
            after=t_after,
        )
        res[(ri, "resume" + tag)].append(r2)
        if not compiled:
            res[(ri, "export")].append(export(roots[ri], env, log, run_dir, work / f"export-{ri}-{rep}"))
        print(
            f"repeat {rep + 1} root {ri}{tag}: train hello {r['hello']} first step {r['first_step']} | "
            f"resume hello {r2['hello']} first step {r2['first_step']}",
            flush=True,
        )
    print()
    print("| root | scenario | spawn -> hello (s) | spawn -> first step (s) | spawn -> exit (s) | CPU (s) | runs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (ri, s), runs in res.items():
        ok = [r for r in runs if r["code"] == 0 and (r["first_step"] is not None or s == "export")]
        if not ok:
            print(f"| {ri} | {s} | failed | failed | failed | failed | 0 |")
            continue
        cells = [_median_range([r[k] for r in ok]) for k in ("hello", "first_step", "total", "cpu")]
        print(f"| {ri} | {s} | {' | '.join(cells)} | {len(ok)} |")
    print(f"\nlogs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
