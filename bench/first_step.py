"""Time to the first step on screen for the README's first command (issue 11 §1), warm caches.

  headless   `gptop --no-ui train --max-steps 200` with stdout a pipe: seconds from the spawn to the first
             line from the trainer (`starting: ...`, the early hello), to the first `startup:` line, and to
             the first `step N/200` line (the first log step: --log-every steps are done by then)
  tui        `gptop train --max-steps 200` in a pseudo-terminal (120x40): seconds until the dashboard has
             drawn `step 1/200` (the header's counter, moved by the first `progress` event)
  full       (--full) the whole headless command, 200 steps: the README's figure
  progress   the cost of one `progress` event (trainer.channel.Channel.emit_live over a Unix socket to a
             reader), in microseconds and as a share of the median step time of the headless run

The first round warms the caches (builtin tokenizer, tokens, the CPU peak) and is not counted. Each
round runs in a fresh empty folder, as a user types the command (no --run-dir). Medians and ranges are
printed, with the machine (CPU model, cores, load average) for BENCHMARKS.md:

    python bench/first_step.py [--repeats 3] [--full] [extra gptop train flags...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import time_first_frame  # noqa: E402  (bench/startup.py: the pseudo-terminal driver)

ROOT = Path(__file__).resolve().parent.parent
README = ["train", "--max-steps", "200"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def headless(cwd: Path, extra: list[str], full: bool = False, timeout: float = 3600.0) -> dict[str, float | None]:
    """Spawn the headless command; the times of its first lines (and the end with `full`)."""
    argv = [sys.executable, "-m", "gptop", "--no-ui", *README, *extra]
    t0 = time.perf_counter()
    p = subprocess.Popen(
        argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    assert p.stdout is not None
    out: dict[str, float | None] = {"starting": None, "startup": None, "first step line": None, "done": None}
    step_ms: list[float] = []
    try:
        for line in p.stdout:
            now = time.perf_counter() - t0
            if out["starting"] is None and line.startswith("starting: "):
                out["starting"] = now
            elif out["startup"] is None and line.startswith("startup: "):
                out["startup"] = now
            elif line.startswith("step "):
                if out["first step line"] is None:
                    out["first step line"] = now
                m = re.search(r"\| step (\d+) ms", line)
                if m:
                    step_ms.append(float(m.group(1)))
                if not full:
                    break
            if now > timeout:
                break
        if full and p.wait() == 0:  # the stream ended: the process is exiting
            out["done"] = time.perf_counter() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    out["step ms"] = statistics.median(step_ms) if step_ms else None
    return out


def progress_cost(n: int = 20000) -> float:
    """Microseconds per `progress` event sent on a Unix socket that a thread reads, as the supervisor does."""
    from trainer.channel import Channel

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        got = [0]

        def read() -> None:
            conn, _ = srv.accept()
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                got[0] += data.count(b"\n")

        t = threading.Thread(target=read, daemon=True)
        t.start()
        ch = Channel(None, f"unix:{path}")
        for i in range(200):  # warm-up
            ch.emit_live("progress", step=i, tokens=i * 4096, step_ms=500.0)
        t0 = time.perf_counter()
        for i in range(n):
            ch.emit_live("progress", step=i, tokens=i * 4096, step_ms=500.0)
        dt = time.perf_counter() - t0
        ch.close()
        t.join(5)
        srv.close()
    return dt / n * 1e6


def machine() -> str:
    from trainer.contract.device import cpu_name

    cpu = cpu_name()
    load = os.getloadavg()
    return f"{cpu}, {os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="also run the whole command (200 steps) once")
    ap.add_argument("--no-tui", action="store_true", help="skip the pseudo-terminal measurement")
    args, extra = ap.parse_known_args()
    results: dict[str, list[float]] = {}
    print(f"machine: {machine()}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        warm.mkdir()
        headless(warm, extra)  # the caches: tokenizer, tokens, CPU peak
        for i in range(args.repeats):
            cwd = Path(tmp) / f"h{i}"
            cwd.mkdir()
            for k, v in headless(cwd, extra).items():
                if v is not None:
                    results.setdefault(f"headless {k}", []).append(v)
            if not args.no_tui:
                cwd = Path(tmp) / f"t{i}"
                cwd.mkdir()
                argv = [sys.executable, "-m", "gptop", *README, *extra]
                results.setdefault("tui step 1/200 on screen", []).append(
                    time_first_frame(argv, ROOT, cwd, marker=b"step 1/200", timeout=300.0)
                )
            print(
                f"round {i + 1}/{args.repeats} done ({machine()}): "
                f"{ {k: round(v[-1], 2) for k, v in results.items()} }",
                file=sys.stderr,
            )
        if args.full:
            cwd = Path(tmp) / "full"
            cwd.mkdir()
            for k, v in headless(cwd, extra, full=True).items():
                if v is not None:
                    results.setdefault(f"full {k}", []).append(v)
    us = progress_cost()
    results["progress event (us)"] = [us]
    print(f"{'measurement':<32} {'median':>9} {'range':>18}")
    for label, vals in results.items():
        print(f"{label:<32} {statistics.median(vals):>9.2f} {min(vals):>8.2f}-{max(vals):.2f}")
    step = results.get("headless step ms") or results.get("full step ms")
    if step:
        print(f"progress event / step time: {us / 1e3 / statistics.median(step):.2e}")
    print(f"machine: {machine()}")
    print(json.dumps({k: statistics.median(v) for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
