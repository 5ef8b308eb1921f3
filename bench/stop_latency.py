"""How long a stop the user asked for takes, and what it reports, depending on when it comes.

Starts `gptop --no-ui train` (a tiny llama on the CPU that outlives the measurement), sends it SIGTERM
(what `kill` or a closing terminal sends; Ctrl-C is SIGINT, handled the same) at one of several moments,
and measures the wall time from the signal to gptop's exit. Each row also shows the exit code and the
last status line, which must be 130 and "stopped" at every moment.

Moments:
  spawned     as soon as the trainer process exists (it is still importing torch)
  1.5s        1.5 s after gptop started (the moment issue 10 names)
  hello       the trainer said hello (model built, not yet stepping)
  step        the first step event
  step+5      five steps later (a graceful stop finishes the step and checkpoints)

Latency is also given as a ratio against `python -c pass` measured in the same round (the cost of
starting any Python), so figures from machines of different speed compare.

    python bench/stop_latency.py                      # every moment, 2 rounds
    python bench/stop_latency.py --rounds 3 --moments 1.5s step --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MOMENTS = ("spawned", "1.5s", "hello", "step", "step+5")
TRAINER = [
    "--model",
    "llama",
    "--size",
    "tiny",
    "--seq-len",
    "64",
    "--global-batch",
    "4",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "0",
    "--device",
    "cpu",
    "--max-steps",
    "1000000",
]


def _events(run_dir: Path) -> list[dict]:
    p = run_dir / "events.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _reached(moment: str, proc: subprocess.Popen, started: float, run_dir: Path) -> bool:
    import psutil

    if moment == "spawned":
        try:
            return bool(psutil.Process(proc.pid).children())
        except psutil.Error:
            return False
    if moment == "1.5s":
        return time.monotonic() - started >= 1.5
    kinds = [e.get("type") for e in _events(run_dir)]
    if moment == "hello":
        return "hello" in kinds
    steps = kinds.count("step")
    return steps >= (1 if moment == "step" else 6)


def python_pass() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - t0


def stop_at(moment: str, timeout: float = 300.0) -> dict:
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gptop", "--no-ui", "train", *TRAINER, "--run-dir", str(run_dir)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            while not _reached(moment, proc, started, run_dir):
                if proc.poll() is not None or time.monotonic() - started > timeout:
                    raise RuntimeError(f"gptop ended or hung before {moment!r}: {proc.stderr.read()[-2000:]}")
                time.sleep(0.01)
            at = time.monotonic() - started
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=timeout)
            latency = time.perf_counter() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        status = [line for line in out.splitlines() if line.startswith("status: ")]
        return {
            "moment": moment,
            "at_s": round(at, 2),
            "stop_s": round(latency, 3),
            "code": proc.returncode,
            "status": status[-1] if status else None,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--moments", nargs="+", choices=MOMENTS, default=list(MOMENTS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {m: [] for m in args.moments}
    base: list[float] = []
    for _ in range(args.rounds):
        for m in args.moments:
            base.append(python_pass())
            r = stop_at(m)
            r["ratio"] = round(r["stop_s"] / base[-1], 1)
            rows[m].append(r)
    if args.json:
        print(json.dumps({"python_pass_s": base, "rows": rows}))
        return 0
    print(f"python -c pass: median {statistics.median(base):.3f} s over {len(base)} runs")
    print(f"{'moment':<9} {'sent at':>8} {'stop (s)':>9} {'x pass':>7}  exit  status")
    ok = True
    for m, rs in rows.items():
        for r in rs:
            print(f"{m:<9} {r['at_s']:>7.2f}s {r['stop_s']:>9.2f} {r['ratio']:>7.1f}  {r['code']:>4}  {r['status']}")
            ok = ok and r["code"] == 130 and bool(r["status"]) and r["status"].startswith("status: stopped")
    print("every stop reported as stopped with exit 130" if ok else "SOME STOPS WERE NOT REPORTED AS STOPPED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
