"""What the dashboard costs: CPU of the gptop process and event-to-screen latency, on a real run.

Starts the real TUI (`gptop train ...`, or with `--mode monitor` a bare trainer plus `gptop
--run-dir` attached to it) inside a pseudo-terminal of the given size, lets it warm up, then for
`--seconds`:

* CPU: user+system time of the gptop process alone (psutil `cpu_times()` of its pid: every thread
  of gptop, i.e. the UI, the device sampler and the event reader, but not the trainer, which is a
  child process with its own pid) divided by wall time, as % of one core. The target is <= 3%
  (issue 13), quiet (`--load 0`) or busy (`--load N`: N processes spinning on the CPU).
* Latency: each step event carries `time` (the trainer's `time.time()` when it built the event).
  The bench reads everything gptop writes to the terminal on a reader thread and notes the wall
  time at which the header text `step N/TOTAL` for that step first appears in the byte stream.
  latency = first seen - event time: trainer -> socket (or events.jsonl in monitor mode) -> gptop's
  reader -> RunState -> the UI's poll -> render -> bytes on the terminal. What it leaves out: a
  real terminal emulator parsing and painting those bytes (about a frame). Its resolution is that
  of the reader thread waking on the pty (well under 1 ms when the machine is idle; when the
  trainer saturates every core, the reader's own scheduling delay is counted too, so the figure
  errs high). Clocks: both sides are `time.time()` on the same machine. The target is <= 250 ms.

Default settings (log every 10 steps, device samples every 0.5 s) are what the CPU target is
about; `--log-every 1` gives a step event (and so a latency sample) every step.

`--mode synthetic` takes the trainer out: the process on the pty is the real GptopApp on a RunState
that a feeder thread fills the way the Session's reader thread does (a step event `--rate` times a
second with `time` = now, a device sample every 0.5 s). It measures the UI's own share of the path
(state change -> screen) with many samples, on a machine where a tiny CPU run logs too rarely.

    python bench/dashboard.py                      # 30 s at 160x48, default settings
    python bench/dashboard.py --size 80x24 --log-every 1 --seconds 60
    python bench/dashboard.py --mode monitor       # `gptop --run-dir` attached to a live trainer
    python bench/dashboard.py --mode synthetic --rate 5 --seconds 60   # the UI alone, 5 events/s
    python bench/dashboard.py --load 2 --compare top   # busy machine, top -b -d 1 measured alongside
    python bench/dashboard.py --mode synthetic --progress-rate 2.2   # a run's per-step progress stream, 0.45 s a step
    python bench/dashboard.py --json               # one JSON object instead of the table
    git worktree add /tmp/gptop-base main          # then: before/after on the same machine, alternating
    python bench/dashboard.py --mode synthetic --progress-rate 2.2 --baseline-tree /tmp/gptop-base --rounds 3

At a fixed event rate (the synthetic mode) the CPU share hardly depends on the machine's load; a live
run's does, because a loaded machine slows the trainer and so the event rate: "CPU per 100 steps"
divides that out.

Extra arguments after `--` go to the trainer (default: a tiny llama on the CPU that outlives the
measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from trainer.contract.device import cpu_name  # noqa: E402  (the project's one reader of /proc/cpuinfo)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures.terminal import Terminal as PtyTerminal  # noqa: E402  (the tests' pty driver, one copy)

DEFAULT_TRAINER = [
    "--model",
    "llama",
    "--size",
    "tiny",
    "--seq-len",
    "64",
    "--global-batch",
    "8",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "0",
]
STEP_RE = re.compile(rb"step (\d+)/(\d+|\?)")


class Terminal(PtyTerminal):
    """gptop on a pseudo-terminal (tests/fixtures/terminal.py) that remembers when each `step N/...` first
    appeared on the screen."""

    def __init__(self, argv: list[str], cols: int, rows: int, env: dict[str, str], cwd: Path | None = None) -> None:
        self.first_seen: dict[int, float] = {}
        self._tail = b""
        super().__init__(argv, cols, rows, env, cwd=cwd, on_output=self._seen, keep_output=False)

    def _seen(self, data: bytes, now: float) -> None:
        buf = self._tail + data
        for m in STEP_RE.finditer(buf):
            self.first_seen.setdefault(int(m.group(1)), now)
        self._tail = buf[-32:]


def read_steps(events: Path, kind: str = "step") -> dict[int, float]:
    """step -> event time of the primary rank's `kind` events (the last one, after a rollback). Progress
    events are in the file only in the synthetic mode (a trainer sends them on the live channel only)."""
    out: dict[int, float] = {}
    if not events.exists():
        return out
    for line in events.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("type") == kind and not e.get("rank"):
            out[int(e["step"])] = float(e["time"])
    return out


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen) -> None:
    t_end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise SystemExit(f"bench: gptop exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > t_end:
            raise SystemExit(f"bench: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


LOAD_CODE = "while True: pass"


def start_load(n: int) -> list[subprocess.Popen]:
    """`n` processes that each keep one core busy (a pure-Python spin: no memory traffic, no I/O), so the
    dashboard is measured on a machine whose cores are all taken, as on a busy training box."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_CODE],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(n)
    ]


def start_compare(what: str, interval: float) -> subprocess.Popen | None:
    """The reference monitor run side by side: `top -b -d INTERVAL` (batch mode: every process, every
    INTERVAL s, written to /dev/null); None when top is not installed."""
    import shutil

    if what == "top" and shutil.which("top"):
        return subprocess.Popen(
            ["top", "-b", "-d", str(interval)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    return None


def stop_procs(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


REPO = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace, trainer: list[str], tree: Path = REPO) -> dict:
    """One measurement, with gptop (and the trainer) imported from `tree`: PYTHONPATH and the working
    directory (`python -m` puts the working directory first on sys.path)."""
    cols, rows = (int(x) for x in args.size.lower().split("x"))
    env = dict(os.environ, TERM="xterm-256color", COLORTERM="truecolor", LINES=str(rows), COLUMNS=str(cols))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree)]
        + [
            p
            for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() not in (REPO, tree.resolve())
        ]
    )
    env.pop("TEXTUAL", None)
    run_dir = Path(tempfile.mkdtemp(prefix="gptop-bench-"))
    flags = trainer + ["--max-steps", str(args.max_steps), "--log-every", str(args.log_every)]
    bare = None
    if args.mode == "synthetic":
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--synthetic-child",
            "--rate",
            str(args.rate),
            "--progress-rate",
            str(args.progress_rate),
            "--run-dir",
            str(run_dir),
        ]
    elif args.mode == "train":
        argv = [sys.executable, "-m", "gptop", "train", *flags, "--run-dir", str(run_dir)]
    else:
        bare = subprocess.Popen(
            [sys.executable, "-m", "trainer", *flags, "--run-dir", str(run_dir)],
            env=env,
            cwd=tree,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        events = run_dir / "events.jsonl"
        wait_for(lambda: events.exists() and b'"hello"' in events.read_bytes(), 300, "the trainer's hello", bare)
        argv = [sys.executable, "-m", "gptop", "--run-dir", str(run_dir)]
    term = Terminal(argv, cols, rows, env, cwd=tree)
    load: list[subprocess.Popen] = []
    ref = None
    try:
        gptop = psutil.Process(term.proc.pid)
        wait_for(
            lambda: (
                (bool(read_steps(run_dir / "events.jsonl")) or bool(read_steps(run_dir / "events.jsonl", "progress")))
                and bool(term.first_seen)
            ),
            600,
            "the first step on screen",
            term.proc,
        )
        load = start_load(args.load)
        ref = start_compare(args.compare, args.compare_interval) if args.compare else None
        refp = psutil.Process(ref.pid) if ref is not None else None
        time.sleep(args.warmup)
        t0, c0, seen0 = time.monotonic(), gptop.cpu_times(), set(term.first_seen)
        r0 = refp.cpu_times() if refp is not None else None
        load0 = os.getloadavg()[0]
        per_second: list[float] = []
        last_t, last_c = t0, c0
        while time.monotonic() - t0 < args.seconds:
            time.sleep(1.0)
            if term.proc.poll() is not None:
                raise SystemExit(
                    f"bench: gptop exited with {term.proc.returncode} during the measurement (raise --max-steps?)"
                )
            now, c = time.monotonic(), gptop.cpu_times()
            per_second.append(100.0 * (c.user + c.system - last_c.user - last_c.system) / (now - last_t))
            last_t, last_c = now, c
        t1, c1, seen1 = time.monotonic(), gptop.cpu_times(), set(term.first_seen)
        r1 = refp.cpu_times() if refp is not None else None
        load1 = os.getloadavg()[0]
        rss = gptop.memory_info().rss
        threads = gptop.num_threads()
        trainer_cpu = None
        if bare is None:
            kids = gptop.children()
            trainer_cpu = kids[0].cpu_percent(0.5) if kids else None
    finally:
        stop_procs(load + ([ref] if ref is not None else []))
        code = term.close()
        if bare is not None and bare.poll() is None:
            bare.send_signal(signal.SIGTERM)
            try:
                bare.wait(30)
            except subprocess.TimeoutExpired:
                bare.kill()
    steps = read_steps(run_dir / "events.jsonl")
    lat = [
        1000.0 * (term.first_seen[s] - steps[s]) for s in sorted(set(term.first_seen) - seen0) if s in steps and s > 0
    ]
    progress = read_steps(run_dir / "events.jsonl", "progress")  # synthetic --progress-rate only
    plat = [
        1000.0 * (term.first_seen[s] - progress[s])
        for s in sorted(set(term.first_seen) - seen0)
        if s in progress and s not in steps and s > 0
    ]
    wall = t1 - t0
    cpu_s = (c1.user + c1.system) - (c0.user + c0.system)
    result = {
        "mode": args.mode,
        "size": f"{cols}x{rows}",
        "log_every": args.log_every,
        "seconds": round(wall, 1),
        **({"rate": args.rate, "progress_rate": args.progress_rate} if args.mode == "synthetic" else {}),
        "gptop_cpu_pct_of_one_core": round(100.0 * cpu_s / wall, 2),
        "gptop_cpu_pct_per_second_max": round(max(per_second), 1) if per_second else None,
        "gptop_rss_mb": round(rss / 2**20, 1),
        "gptop_threads": threads,
        "latency_samples": len(lat),
        "latency_ms_median": round(statistics.median(lat), 1) if lat else None,
        "latency_ms_p95": round(pct(lat, 0.95), 1) if lat else None,
        "latency_ms_max": round(max(lat), 1) if lat else None,
        "latency_ms_all": [round(x, 1) for x in lat],
        # the steps between log steps, drawn from progress events alone (at most twice a second, see
        # gptop.ui.widgets.RunHeader.SLOW_AREAS): only the first of a burst of steps is ever on screen
        "progress_latency_samples": len(plat),
        "progress_latency_ms_median": round(statistics.median(plat), 1) if plat else None,
        "progress_latency_ms_max": round(max(plat), 1) if plat else None,
        "terminal_kb_per_s": round(term.bytes / 1024 / max(1e-9, wall), 1),
        # steps the header counted during the window (progress events move it every step): the input rate
        "steps_per_s": round((max(seen1) - max(seen0)) / wall, 2) if seen0 and seen1 else None,
        # the load-independent figure: CPU per unit of input (the CPU share moves with the step rate, which a
        # loaded machine changes; at a fixed rate, as in the synthetic mode, the two say the same)
        "gptop_cpu_ms_per_100_steps": (
            round(1e5 * cpu_s / (max(seen1) - max(seen0)), 1) if seen0 and seen1 and max(seen1) > max(seen0) else None
        ),
        "gptop_exit_code": code,
        "machine_cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "load_avg_1m_during": [round(load0, 2), round(load1, 2)],
        "load_procs": args.load,
        "cpu_model": cpu_name(),
        "run_dir": str(run_dir),
    }
    if trainer_cpu is not None:
        result["trainer_cpu_pct_of_one_core"] = round(trainer_cpu, 1)
    if args.compare:
        result["compare"] = f"{args.compare} every {args.compare_interval:g} s"
        result["compare_cpu_pct_of_one_core"] = (
            round(100.0 * ((r1.user + r1.system) - (r0.user + r0.system)) / wall, 2) if r0 is not None else None
        )
    return result


def synthetic_child(rate: float, progress_rate: float, run_dir: Path) -> None:
    """The dashboard on a RunState fed by a thread (the Session's role), also writing the step (and
    progress) events to run_dir/events.jsonl so the parent can match them with the screen. With
    `progress_rate`, the stream is a run's: a progress event every step, `progress_rate` a second, and a step
    event every 10th step (`rate` is then ignored)."""
    import math
    import random

    sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: BEFORE/AFTER trees
    from gptop.controls import RecordingCommands
    from gptop.state import RunState
    from gptop.ui.app import GptopApp
    from trainer.contract import events as ev

    state = RunState(run_name="synthetic", run_dir=str(run_dir), clock=time.time, status="running")
    total = 1_000_000
    state.apply(
        ev.make(
            "hello",
            config={"optim": {"max_steps": total}, "toggles": {"precision": "fp32", "compile": "off"}},
            device={"type": "cpu", "name": "synthetic CPU"},
            model={"family": "llama", "size": "tiny", "total_params": 3_000_000, "active_params": 3_000_000},
        )
    )
    out = open(run_dir / "events.jsonl", "a", buffering=1)
    stop = threading.Event()

    def feed() -> None:
        rng = random.Random(0)
        step, next_step, next_dev = 0, time.time(), time.time()
        every = (1.0 / progress_rate) if progress_rate > 0 else None
        while not stop.is_set():
            now = time.time()
            if now >= next_dev:
                state.apply(
                    ev.DeviceEvent(
                        time=now,
                        devices=[],
                        mode="cpu",
                        cpu=ev.CpuReading(
                            name="synthetic CPU",
                            util_pct=50 + 40 * math.sin(now / 5),
                            per_core=[50.0, 70.0],
                            mem_used=2 << 30,
                            mem_total=16 << 30,
                            proc_rss=1 << 29,
                            proc_cpu_pct=90.0,
                            power_w=None,
                            energy_j=None,
                        ),
                    )
                )
                next_dev += 0.5
            if now >= next_step:
                step += 1
                ms = 1000 * every if every is not None else 200 + 20 * math.sin(step / 10)
                if every is not None:  # a run's stream: a progress event each step, a step event every 10th
                    p = ev.ProgressEvent(time=now, step=step, tokens=step * 512, step_ms=ms)
                    out.write(ev.dumps(p) + "\n")
                    state.apply(p)
                if every is None or step % 10 == 0:
                    e = ev.StepEvent(
                        time=now,
                        step=step,
                        tokens=step * 512,
                        loss=2 + 8 * math.exp(-step / 300),
                        lr=1e-3,
                        grad_norm=1.0,
                        step_ms=ms,
                        phases_ms={
                            "data": 2.0,
                            "forward": ms * 0.3,
                            "backward": ms * 0.55,
                            "optimizer": ms * 0.14,
                            "other": ms * 0.01,
                        },
                        tokens_per_s=512 / ms * 1000,
                        mfu=None,
                        mem_bytes=600_000_000,
                    )
                    out.write(ev.dumps(e) + "\n")
                    state.apply(e)
                # jittered, not in phase with any timer
                next_step = now + (rng.uniform(0.9, 1.1) * every if every is not None else rng.uniform(0.5, 1.5) / rate)
            time.sleep(max(0.0, min(next_step, next_dev) - time.time()))

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    GptopApp(state, RecordingCommands()).run()
    stop.set()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument(
        "--mode",
        choices=("train", "monitor", "synthetic"),
        default="train",
        help="train: `gptop train` runs the trainer; monitor: `gptop --run-dir` attached to a live "
        "trainer; synthetic: the dashboard fed by a thread, no trainer (default: train)",
    )
    ap.add_argument("--rate", type=float, default=5.0, help="synthetic: step events per second (default: 5)")
    ap.add_argument(
        "--progress-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="synthetic: a run's stream instead, a progress event R times a second (one per step, as a "
        "trainer sends them) and a step event every 10th step (default: 0, off)",
    )
    ap.add_argument("--synthetic-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default="160x48", help="terminal COLSxROWS (default: 160x48)")
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement length (default: 30)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds after the first step is on screen before measuring (default: 5)",
    )
    ap.add_argument("--log-every", type=int, default=10, help="trainer's --log-every (default: 10, its default)")
    ap.add_argument("--max-steps", type=int, default=100000, help="trainer's --max-steps (default: 100000)")
    ap.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="keep N more processes spinning on the CPU during the measurement, e.g. one per core "
        "for a busy machine (default: 0)",
    )
    ap.add_argument(
        "--compare",
        choices=("top",),
        default=None,
        help="run this monitor side by side during the same window and report its CPU too",
    )
    ap.add_argument(
        "--compare-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="the compared monitor's refresh period (default: 1 s)",
    )
    ap.add_argument("--rounds", type=int, default=1, metavar="N", help="measure N times (default: 1)")
    ap.add_argument(
        "--baseline-tree",
        default=None,
        metavar="DIR",
        help="also measure gptop imported from DIR (another checkout, e.g. `git worktree add "
        "/tmp/gptop-base main`), alternating with this tree for --rounds rounds, and print the "
        "medians and the ratio this tree / DIR",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object per measurement")
    args, extra = ap.parse_known_args()
    if args.synthetic_child:
        synthetic_child(args.rate, args.progress_rate, Path(args.run_dir))
        return
    trainer = [a for a in extra if a != "--"] or DEFAULT_TRAINER
    if args.baseline_tree:
        compare_trees(args, trainer, Path(args.baseline_tree))
        return
    for _ in range(args.rounds):
        r = measure(args, trainer)
        if args.json:
            print(json.dumps(r))
        else:
            report(r)


def compare_trees(args: argparse.Namespace, trainer: list[str], base: Path) -> None:
    """`--rounds` measurements of each tree, alternating (baseline first), so that both see the same
    machine; one line each, then the medians and the ratio this tree / baseline."""
    if not (base / "gptop" / "ui" / "app.py").exists():
        raise SystemExit(
            f"bench: --baseline-tree {base}: no gptop/ui/app.py there; give a checkout of gptop, "
            "e.g. `git worktree add /tmp/gptop-base main`"
        )
    results: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    for i in range(args.rounds):
        for name, tree in (("baseline", base), ("this tree", REPO)):
            r = measure(args, trainer, tree)
            r["tree"] = str(tree)
            results[name].append(r)
            if args.json:
                print(json.dumps(r))
            else:
                print(
                    f"round {i + 1} {name:9s} ({tree}): {r['gptop_cpu_pct_of_one_core']:.2f}% of one core "
                    f"(worst second {r['gptop_cpu_pct_per_second_max']}%), "
                    f"{r['gptop_cpu_ms_per_100_steps']} ms CPU per 100 steps, {r['steps_per_s']} steps/s, "
                    f"latency p95 {r['latency_ms_p95']} ms, top {r.get('compare_cpu_pct_of_one_core')}%, load "
                    f"{r['load_avg_1m_during'][0]}-{r['load_avg_1m_during'][1]}",
                    flush=True,
                )

    def med(name: str, key: str) -> float | None:
        vals = [r[key] for r in results[name] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    if args.json:
        return
    print(f"medians over {args.rounds} round(s), {REPO} vs baseline {base}:")
    for key, label in (
        ("gptop_cpu_pct_of_one_core", "% of one core"),
        ("gptop_cpu_ms_per_100_steps", "ms CPU per 100 steps"),
        ("latency_ms_p95", "latency p95 ms"),
    ):
        b, t = med("baseline", key), med("this tree", key)
        ratio = f"{t / b:.2f}" if b and t is not None else "n/a"
        print(
            f"  {label:22s} baseline {b if b is None else round(b, 2)}  this tree "
            f"{t if t is None else round(t, 2)}  ratio {ratio}"
        )


def report(r: dict) -> None:
    ok_cpu = r["gptop_cpu_pct_of_one_core"] <= 3.0
    ok_lat = r["latency_ms_p95"] is not None and r["latency_ms_p95"] <= 250.0
    print(
        f"gptop dashboard cost: mode {r['mode']}, {r['size']}, --log-every {r['log_every']}, "
        f"{r['seconds']:.0f} s measured, {r['cpu_model']}, {r['machine_cpus']} CPUs, load "
        f"{r['load_avg_1m_during'][0]}-{r['load_avg_1m_during'][1]}"
        + (f" (with {r['load_procs']} spinning processes)" if r["load_procs"] else "")
    )
    print(
        f"  CPU of the gptop process: {r['gptop_cpu_pct_of_one_core']:.2f}% of one core "
        f"(worst second {r['gptop_cpu_pct_per_second_max']}%)  target <= 3%: {'ok' if ok_cpu else 'MISSED'}"
    )
    if r.get("compare"):
        print(f"  side by side, {r['compare']}: {r['compare_cpu_pct_of_one_core']}% of one core")
    if r["latency_samples"]:
        print(
            f"  event -> screen: median {r['latency_ms_median']:.0f} ms, p95 {r['latency_ms_p95']:.0f} ms, "
            f"max {r['latency_ms_max']:.0f} ms over {r['latency_samples']} step events  "
            f"target <= 250 ms: {'ok' if ok_lat else 'MISSED'}"
        )
    else:
        print("  event -> screen: no step event during the measurement (raise --seconds or lower --log-every)")
    if r.get("progress_latency_samples"):
        print(
            f"  progress event -> screen (the counter between log steps): median "
            f"{r['progress_latency_ms_median']:.0f} ms, max {r['progress_latency_ms_max']:.0f} ms over "
            f"{r['progress_latency_samples']} steps shown"
        )
    if r["steps_per_s"] is not None:
        print(f"  steps counted on screen: {r['steps_per_s']} a second")
    if r["gptop_cpu_ms_per_100_steps"] is not None:
        print(f"  CPU per 100 steps on screen: {r['gptop_cpu_ms_per_100_steps']} ms")
    print(
        f"  gptop RSS {r['gptop_rss_mb']} MB, {r['gptop_threads']} threads, terminal output "
        f"{r['terminal_kb_per_s']} KB/s"
        + (f"; trainer {r['trainer_cpu_pct_of_one_core']}% of one core" if "trainer_cpu_pct_of_one_core" in r else "")
    )


if __name__ == "__main__":
    main()
