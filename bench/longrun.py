"""What a long run costs gptop: `gptop report` and the monitor's replay of run directories of N step events, and
the live session's memory over a week of events.

    python bench/longrun.py report [--steps 10000 100000] [--template RUN_DIR] [--json]
    python bench/longrun.py live [--days 7] [--steps-per-s 10] [--log-every 10 1] [--json]

`report`: builds a run directory per N (events.jsonl with N step events of `--log-every 1`, device.jsonl with
2N device samples, both cloned from a real tiny run's lines: `--template RUN_DIR`, or a 12-step run this script
makes first), then runs `gptop report RUN_DIR`, the monitor's replay `gptop --no-ui --run-dir RUN_DIR` (which
prints a line per step event it reads) and an attach (the monitor's session filling the dashboard's state, the
TUI's work less the drawing) in their own processes and reports each one's wall time and peak RSS (the
kernel's `ru_maxrss` of that child).
Bounded memory: the peak RSS stays flat as N grows; linear time: seconds per million step events stays flat.

`live`: streams a run's events (a step event per `--log-every` steps, a progress event for every other step, a
device sample every 0.5 s, an occasional checkpoint) through the session's reducer, the headless view, the
alert monitor and the metrics collector in this process, as `gptop --no-ui train` does, for `--days` of run
time at `--steps-per-s`, and reports RSS at the start, at each tenth and at the end: flat means bounded.
The events are fed as fast as the CPU allows (no sleeping), with a clock that follows the events' time.

Say the machine's load (`cat /proc/loadavg`) next to the figures: they are wall times.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# --- building a long run directory ----------------------------------------------------------------------------------


def make_template(where: Path) -> Path:
    """A real tiny run (12 steps, --log-every 1) to clone lines from."""
    run = where / "template"
    if (run / "events.jsonl").is_file():
        return run
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gptop",
            "--no-ui",
            "train",
            "--model",
            "llama",
            "--size",
            "tiny",
            "--seq-len",
            "64",
            "--global-batch",
            "4",
            "--max-steps",
            "12",
            "--log-every",
            "1",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--device",
            "cpu",
            "--run-dir",
            str(run),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return run


def template_lines(run: Path) -> dict[str, object]:
    """The template's early and full hello, its last step event and its last device sample, as dicts."""
    out: dict[str, object] = {}
    for line in (run / "events.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["type"] == "hello":
            out["early" if d.get("early") else "hello"] = d
        elif d["type"] == "step":
            out["step"] = d
    for line in (run / "device.jsonl").read_text().splitlines():
        out["device"] = json.loads(line)
    missing = {"early", "hello", "step", "device"} - set(out)
    if missing:
        raise SystemExit(f"{run}: no {', '.join(sorted(missing))} line to clone")
    return out


def write_run(run: Path, n: int, tpl: dict, step_s: float = 0.1) -> tuple[int, int]:
    """A run directory of `n` step events (and 2n device samples) at `step_s` seconds per step; (bytes of
    events.jsonl, bytes of device.jsonl). The step and device lines are the template's with the step, tokens
    and times moved on: a long run's files as gptop writes them."""
    run.mkdir(parents=True, exist_ok=True)
    t0 = 1_800_000_000.0
    hello, early, step, device = (dict(tpl[k]) for k in ("hello", "early", "step", "device"))  # type: ignore[arg-type]
    per = step.get("tokens", 256) // max(1, step.get("step", 1))
    hello["config"] = json.loads(json.dumps(hello["config"]))
    hello["config"].setdefault("optim", {})["max_steps"] = n
    head = [dict(early, time=t0), dict(hello, time=t0 + 1)]
    # the step line split around the fields that move, so each line is one string join
    step_rest = json.dumps({k: v for k, v in step.items() if k not in ("time", "step", "tokens", "batch")})[1:]
    dev_rest = json.dumps({k: v for k, v in device.items() if k != "time"})[1:]
    with open(run / "events.jsonl", "w") as ev, open(run / "device.jsonl", "w") as dv:
        for h in head:
            ev.write(json.dumps(h, separators=(",", ":")) + "\n")
        buf_e, buf_d = [], []
        for i in range(1, n + 1):
            t = t0 + 2 + i * step_s
            buf_e.append(f'{{"time":{t:.3f},"step":{i},"tokens":{i * per},"batch":{i - 1},{step_rest}\n')
            buf_d.append(f'{{"time":{t - step_s / 2:.3f},{dev_rest}\n{{"time":{t:.3f},{dev_rest}\n')
            if len(buf_e) >= 10_000:
                ev.write("".join(buf_e))
                dv.write("".join(buf_d))
                buf_e, buf_d = [], []
        ev.write("".join(buf_e))
        dv.write("".join(buf_d))
        done = {
            "v": 1,
            "type": "done",
            "time": t0 + 3 + n * step_s,
            "rank": 0,
            "step": n,
            "tokens": n * per,
            "reason": "max_steps",
        }
        ev.write(json.dumps(done) + "\n")
    return (run / "events.jsonl").stat().st_size, (run / "device.jsonl").stat().st_size


# What the dashboard does when it attaches (the monitor's session filling its state, without the TUI's drawing):
# a child process, from start to the state holding the run's last step.
ATTACH = """
import sys
from pathlib import Path
from gptop.monitor import MonitorSession
class NoSampler:
    def subscribe(self, fn): pass
    def start(self): pass
    def stop(self): pass
s = MonitorSession(Path(sys.argv[1]), sampler=NoSampler())
s.start()
assert s.replayed.wait(3600)
assert s.state.done is not None, "the run's end was not read"
s.close()
"""


def measure_child(argv: list[str], timeout: float = 3600) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of one child process."""
    t = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode() if p.stderr else ""
    if p.returncode not in (0, 1):
        print(err[-2000:], file=sys.stderr)
    return time.perf_counter() - t, usage.ru_maxrss * 1024, p.returncode


def bench_report(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="gptop-longrun-") as tmp:
        where = Path(tmp)
        tpl = template_lines(Path(args.template) if args.template else make_template(where))
        env_py = [sys.executable, "-m", "gptop"]
        for n in args.steps:
            run = where / f"run-{n}"
            t = time.perf_counter()
            size_e, size_d = write_run(run, n, tpl)
            built = time.perf_counter() - t
            rep = measure_child(env_py + ["report", str(run)])
            mon = measure_child(env_py + ["--no-ui", "--run-dir", str(run)])
            att = measure_child([sys.executable, "-c", ATTACH, str(run)])
            row = {
                "steps": n,
                "events_mb": size_e / 1e6,
                "device_mb": size_d / 1e6,
                "built_s": built,
                "report_s": rep[0],
                "report_rss_mb": rep[1] / 1e6,
                "report_exit": rep[2],
                "replay_s": mon[0],
                "replay_rss_mb": mon[1] / 1e6,
                "replay_exit": mon[2],
                "attach_s": att[0],
                "attach_rss_mb": att[1] / 1e6,
                "report_s_per_m": rep[0] / n * 1e6,
                "load": os.getloadavg()[0],
            }
            rows.append(row)
            if not args.json:
                print(
                    f"{n:>9,} steps | events.jsonl {row['events_mb']:7.1f} MB, device.jsonl {row['device_mb']:7.1f} MB"
                    f" | report {rep[0]:6.2f} s {row['report_rss_mb']:6.0f} MB"
                    f" | replay {mon[0]:6.2f} s {row['replay_rss_mb']:6.0f} MB"
                    f" | attach {att[0]:5.2f} s {row['attach_rss_mb']:4.0f} MB | load {row['load']:.1f}",
                    flush=True,
                )
            import shutil

            shutil.rmtree(run)
    return rows


# --- the live session -------------------------------------------------------------------------------------------------


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def live_run(days: float, steps_per_s: float, log_every: int, json_out: bool) -> dict:
    """Stream `days` of a run through RunState + HeadlessView + AlertMonitor + the metrics collector."""
    from gptop.alerts import AlertMonitor
    from gptop.headless import HeadlessView
    from gptop.metrics import RunCollector
    from gptop.state import RunState
    from trainer.contract.device import DeviceInfo
    from trainer.contract.events import (
        CheckpointEvent,
        CpuReading,
        DeviceEvent,
        GpuReading,
        HelloEvent,
        ModelInfo,
        ProgressEvent,
        StepEvent,
    )

    clock = [1_800_000_000.0]
    state = RunState(run_name="live", clock=lambda: clock[0])
    view = HeadlessView(state, json=False, stream=io.StringIO(), progress=False)
    alerts = AlertMonitor(clock=lambda: clock[0])
    collector = RunCollector("node")
    collector.state = state
    sink = view.stream

    def feed(e) -> None:
        state.apply(e)
        view.on_event(e)
        for a in alerts.on_event(e):
            state.apply(a)
            view.on_event(a)

    total_steps = int(days * 86400 * steps_per_s)
    feed(
        HelloEvent(
            time=clock[0],
            early=True,
            config={"optim": {"max_steps": total_steps}, "log": {"log_every": log_every}},
            device=DeviceInfo(type="cuda", name="H100"),
            model=ModelInfo(family="llama", size="small"),
        )
    )
    feed(
        HelloEvent(
            time=clock[0],
            config={
                "optim": {"max_steps": total_steps},
                "log": {"log_every": log_every},
                "checkpoint": {"checkpoint_every": 5000},
            },
            device=DeviceInfo(type="cuda", name="H100"),
            model=ModelInfo(family="llama", size="small"),
        )
    )
    dt = 1.0 / steps_per_s
    next_dev = clock[0]
    marks = []
    start = rss()
    t_start = time.perf_counter()
    phases = {"data": 1.0, "forward": 30.0, "backward": 60.0, "optimizer": 8.0, "other": 1.0}
    for i in range(1, total_steps + 1):
        clock[0] += dt
        t = clock[0]
        if i % log_every == 0:
            feed(
                StepEvent(
                    time=t,
                    step=i,
                    tokens=i * 4096,
                    loss=2.0 + 1.0 / (1 + i / 1e5) + (i % 7) * 0.01,
                    lr=3e-4,
                    grad_norm=1.0,
                    step_ms=dt * 1000,
                    phases_ms=phases,
                    tokens_per_s=4096 * steps_per_s,
                    mfu=0.4,
                    mem_bytes=40 << 30,
                    interval_steps=log_every,
                )
            )
        else:
            feed(ProgressEvent(time=t, step=i, tokens=i * 4096, step_ms=dt * 1000))
        while next_dev <= t:
            next_dev += 0.5
            feed(
                DeviceEvent(
                    time=next_dev,
                    mode="gpu",
                    devices=[
                        GpuReading(
                            index=0,
                            name="H100",
                            util_pct=97.0,
                            mem_used=50 << 30,
                            mem_total=80 << 30,
                            power_w=600.0,
                            power_limit_w=700.0,
                            energy_j=next_dev * 600.0,
                            temp_c=65.0,
                            sm_clock_mhz=1980.0,
                            sm_clock_max_mhz=1980.0,
                            clock_reasons=[],
                        )
                    ],
                    cpu=CpuReading(util_pct=10.0, per_core=[10.0] * 16, mem_used=1 << 34, mem_total=1 << 37),
                )
            )
        if i % 5000 == 0:
            feed(CheckpointEvent(time=t, step=i, path=f"/runs/live/checkpoints/step-{i:08d}.pt", seconds=2.0))
            list(collector.collect())  # a scrape now and then
        if i % max(1, total_steps // 10) == 0:
            marks.append((i, rss()))
            sink.seek(0)
            sink.truncate()  # the view's output is the terminal's, not ours to keep
    out = {
        "days": days,
        "steps_per_s": steps_per_s,
        "log_every": log_every,
        "steps": total_steps,
        "rss_start_mb": start / 1e6,
        "rss_end_mb": rss() / 1e6,
        "rss_marks_mb": [m / 1e6 for _, m in marks],
        "seconds": time.perf_counter() - t_start,
        "alerts": state.alerts_raised,
        "load": os.getloadavg()[0],
    }
    if not json_out:
        print(
            f"{days:g} days at {steps_per_s:g} steps/s, --log-every {log_every}: {total_steps:,} steps in "
            f"{out['seconds']:.0f} s | RSS start {out['rss_start_mb']:.0f} MB, end {out['rss_end_mb']:.0f} MB, "
            f"at each tenth {', '.join(f'{m:.0f}' for m in out['rss_marks_mb'])} MB | alerts {out['alerts']} "
            f"| load {out['load']:.1f}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("report", help="gptop report and the monitor's replay of N-step run directories")
    r.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000])
    r.add_argument("--template", default=None, help="a run directory to clone lines from (default: make one)")
    r.add_argument("--json", action="store_true")
    lv = sub.add_parser("live", help="the live session's RSS over days of events")
    lv.add_argument("--days", type=float, default=7.0)
    lv.add_argument("--steps-per-s", type=float, default=1.0)
    lv.add_argument("--log-every", type=int, nargs="+", default=[10, 1])
    lv.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.what == "report":
        rows = bench_report(args)
    else:
        rows = [live_run(args.days, args.steps_per_s, n, args.json) for n in args.log_every]
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
