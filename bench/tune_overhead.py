"""What tuning costs a run: `gptop tune` against the same run without tuning, end to end.

    python bench/tune_overhead.py                           # llama tiny, 200 steps, --budget 10m, one pair
    python bench/tune_overhead.py --steps 2000 --rounds 2   # a longer run, two pairs (train, tune, tune, train)

Each pair runs `gptop --no-ui train ARGS` and `gptop --no-ui tune --budget B ARGS` (the same ARGS, a fresh
run directory each, a fresh study for the tuning: a first use, as a new user has it), one after the other on
this machine, and times each from launch to exit. Reported: each run's wall time, the tuned run's ratio to
the untuned one (the median ratio over the pairs), what the tuning decided (its `tuner:` outcome line) and its
ledger (cost, switch, projected saving, net), and the load average before and after each run, since on a
shared machine a ratio is only as good as the load was even. The issue's bar: the tuned run ends no later than
1.15x the untuned one. With --rounds above 1 the order alternates, so a drift in the machine's load does not
always favour the same side. --json writes everything to a file.
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

BAR = 1.15


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def run(kind: str, args: list[str], budget: str, workdir: Path, env: dict[str, str]) -> dict:
    run_dir = workdir / f"{kind}-{time.strftime('%H%M%S')}"
    argv = [
        sys.executable,
        "-m",
        "gptop",
        "--no-ui",
        kind,
        *(["--budget", budget] if kind == "tune" else []),
        *args,
        "--run-dir",
        str(run_dir),
    ]
    before = loadavg()
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(workdir))
    wall = time.monotonic() - t0
    out = {
        "kind": kind,
        "argv": argv[3:],
        "wall_s": round(wall, 2),
        "rc": p.returncode,
        "load_before": before,
        "load_after": loadavg(),
    }
    lines = (p.stdout + p.stderr).splitlines()
    out["tuner"] = [
        line
        for line in lines
        if line.startswith(
            ("tuner: keeping", "tuner: applying", "tuner: tuning ended", "tuner: stopped exploring", "tuner: no trial")
        )
    ]
    out["trials"] = sum(1 for line in lines if line.startswith("trial "))
    report = run_dir / "tuning.json"
    if report.is_file():
        led = json.loads(report.read_text()).get("ledger") or {}
        out["ledger"] = {
            k: led.get(k)
            for k in (
                "budget_s",
                "requested_budget_s",
                "tuning_s",
                "trials_run",
                "cost_s",
                "switch_s",
                "saving_s",
                "net_s",
            )
        }
    if p.returncode != 0:
        out["stderr_tail"] = p.stderr[-2000:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="--max-steps of both runs (default: 200)")
    ap.add_argument("--budget", default="10m", help="the tuning budget (default: 10m)")
    ap.add_argument("--rounds", type=int, default=1, help="pairs of runs, the order alternating (default: 1)")
    ap.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS for the trainers (default: unset, as a user runs it)"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the results to this file")
    ap.add_argument(
        "args",
        nargs="*",
        default=["--model", "llama", "--size", "tiny"],
        help="the run's options after -- (default: --model llama --size tiny)",
    )
    a = ap.parse_args()
    args = [*a.args, "--max-steps", str(a.steps)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    results, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="gptop-tune-overhead-") as tmp:
        workdir = Path(tmp)
        for r in range(a.rounds):
            order = ("train", "tune") if r % 2 == 0 else ("tune", "train")
            pair = {}
            for kind in order:
                env["GPTOP_CACHE"] = str(workdir / f"cache-{r}")  # a fresh study for every tuning
                res = run(kind, args, a.budget, workdir, env)
                pair[kind] = res
                results.append(res)
                print(
                    f"round {r + 1} {kind:5}: {res['wall_s']:7.1f} s  rc {res['rc']}  load {res['load_before']} -> "
                    f"{res['load_after']}" + (f"  {res['trials']} trials" if kind == "tune" else ""),
                    flush=True,
                )
                for line in res["tuner"]:
                    print(f"              {line}", flush=True)
                if "ledger" in res:
                    print(f"              ledger {res['ledger']}", flush=True)
            ratio = pair["tune"]["wall_s"] / pair["train"]["wall_s"]
            ratios.append(ratio)
            print(f"round {r + 1} ratio tune/train: {ratio:.3f}", flush=True)
    ratio = statistics.median(ratios)
    verdict = "meets" if ratio <= BAR else "misses"
    print(
        f"\ngptop tune --budget {a.budget} {' '.join(args)}: {ratio:.3f}x the same run without tuning "
        f"({verdict} the {BAR}x bar; median of {len(ratios)} pair(s))"
    )
    if a.json:
        a.json.write_text(
            json.dumps(
                {"args": args, "budget": a.budget, "ratios": ratios, "ratio": ratio, "bar": BAR, "runs": results},
                indent=2,
            )
        )
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
