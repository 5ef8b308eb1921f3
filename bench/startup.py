"""Start-up: how long gptop takes before it shows anything, as ratios against `python -c pass`.

  help          `gptop --help`
  first line    `gptop --no-ui --json train ...`: until the first JSON line (the session's "starting"
                status, before the trainer has said anything); the trainer is then killed
  first frame   `gptop train ...` in a pseudo-terminal: until the TUI has drawn its header (the run
                name, which holds the model's name) on the screen

Both train scenarios run in an empty folder without --run-dir, as a user types them (the default run
directory's name needs the resolved config).

Each measurement spawns a fresh interpreter; the scenarios alternate over `--repeats` rounds and
medians are reported, each divided by the same round's `python -c pass`. `--root DIR` measures
another checkout (e.g. `git worktree add /tmp/before <commit>`) in the same rounds:

    python bench/startup.py [--repeats 7] [--root DIR ...]
"""

from __future__ import annotations

import argparse
import os
import pty
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["train", "--model", "llama", "--size", "tiny", "--max-steps", "2", "--device", "cpu"]


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root)
    return env


def time_run(argv: list[str], root: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=root, env=_env(root), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def time_first_line(argv: list[str], root: Path, cwd: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(
        argv, cwd=cwd, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    dt = time.perf_counter() - t0
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    if not line:
        raise RuntimeError(f"no output from {' '.join(argv)}")
    return dt


def time_first_frame(argv: list[str], root: Path, cwd: Path, marker: bytes, timeout: float = 60.0) -> float:
    """Spawn in a pseudo-terminal (120x40) and wait until `marker` has been written to the screen."""
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # child
        os.chdir(cwd)
        env = _env(root)
        env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
        os.execvpe(argv[0], argv, env)
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    seen = b""
    dt = None
    try:
        while time.perf_counter() - t0 < timeout:
            r, _, _ = select.select([fd], [], [], 0.05)
            if r:
                try:
                    seen += os.read(fd, 65536)
                except OSError:
                    break
                if marker in seen:
                    dt = time.perf_counter() - t0
                    break
    finally:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
    if dt is None:
        raise RuntimeError(f"{marker!r} not drawn within {timeout} s")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--root", action="append", default=None, help="checkouts to measure (default: this one)")
    args = ap.parse_args()
    roots = [Path(r).resolve() for r in (args.root or [str(ROOT)])]
    py = sys.executable
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for root in roots:
                base = time_run([py, "-c", "pass"], root)
                results.setdefault((str(root), "python -c pass (s)"), []).append(base)
                cwd = Path(tmp) / f"{root.name}-{i}"  # runs/<time>-llama-tiny is created here
                cwd.mkdir()
                scen = {
                    "help": lambda: time_run([py, "-m", "gptop", "--help"], root),
                    "first line": lambda: time_first_line([py, "-m", "gptop", "--no-ui", "--json", *TRAIN], root, cwd),
                    "first frame": lambda: time_first_frame([py, "-m", "gptop", *TRAIN], root, cwd, marker=b"llama"),
                }
                for label, fn in scen.items():
                    dt = fn()
                    results.setdefault((str(root), label), []).append(dt / base)
                print(f"round {i + 1}/{args.repeats} done", file=sys.stderr)
    print(f"{'checkout':<40} {'scenario':<22} {'median':>8} {'range':>16}")
    for (root, label), vals in results.items():
        unit = "" if "(s)" in label else "x"
        print(f"{root:<40} {label:<22} {statistics.median(vals):>7.2f}{unit} {min(vals):>7.2f}-{max(vals):.2f}{unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
