"""A fault campaign against the trainer and gptop (issue 10, "Done when"); prints its figures.

    python bench/faults.py [--kills 10] [--seed 0] [--json]

1. kill -9: an uninterrupted reference run, then one run directory trained through `--kills` SIGKILLs
   of the trainer, half while a checkpoint is being written (a `*.tmp` is in checkpoints/, the 1st to 3rd
   write of that start), half at a random moment 1-4 steps into a start; each followed by
   `--resume RUN_DIR`. Every resume must be exact:
   every step's loss equals the reference's bit for bit, and the final weights and optimizer state are
   equal; no checkpoint on disk is partial, every one loads.
2. Disk full (a 60 MiB tmpfs: room for one tiny checkpoint, not two), a disk that fills up while events
   are written (under gptop with --restart-on-failure: no crash loop), and a checkpoint directory that
   turns read-only mid-run (a read-only bind mount): exit 8, an error event of kind `disk` naming the path, the errno text and the free
   bytes, the previous checkpoint intact, no temporary file. These need root (mount); skipped otherwise.
3. The NaN cases of issue 10 §1 (`--lr 1e4 --warmup-steps 0 --checkpoint-every 1`, `--lr inf`): every
   checkpoint on disk finite, and the run recovers or stops with the `nan` error (or the input is refused).
4. Two writers on one run directory: a second gptop and a bare trainer are refused (exit 2, naming the
   holder's pid and host) while the first run finishes alone.
5. `gptop export --force` aimed at a live run, a run's checkpoints/, a folder holding runs, the current
   directory, a symlink to a live run, a `..` path to a run and a directory export did not write: exit 2
   before anything loads, nothing changed, the live run goes on; an earlier export is replaced; a kill -9 of
   the export worker leaves the previous export and the next export removes its debris; a new run in a
   copied run directory is refused.

Tiny llama on the CPU (219-286 s on a 2-core machine at load 9-12, 2026-11-25). Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer import checkpoint_files as ckpt  # noqa: E402
from trainer.contract import rundir  # noqa: E402
from trainer.contract.events import ErrorEvent, HelloEvent, StepEvent, read_events  # noqa: E402

ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
TINY = [
    "--model",
    "llama",
    "--size",
    "tiny",
    "--seq-len",
    "64",
    "--global-batch",
    "4",
    "--micro-batch",
    "4",
    "--warmup-steps",
    "2",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--device",
    "cpu",
]
TRAINER = [sys.executable, "-m", "trainer"]
GPTOP = [sys.executable, "-m", "gptop", "--no-ui"]

results: dict[str, Any] = {}
failures: list[str] = []


def check(ok: bool, what: str) -> bool:
    if not ok:
        failures.append(what)
        print(f"  FAILED: {what}", flush=True)
    return ok


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "ab")
    try:
        return subprocess.Popen(
            cmd, stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=ENV, cwd=ROOT, start_new_session=True
        )
    finally:
        f.close()


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def events(run_dir: Path) -> list:
    path = rundir.RunDir(run_dir).events()
    return list(read_events(path)) if path.exists() else []


def step_losses(evs: list) -> list[tuple[int, float]]:
    return [(e.step, e.loss) for e in evs if isinstance(e, StepEvent)]


def n_starts(evs: list) -> int:
    """Trainer starts: full hello events (each start also sends an early one before the model is built)."""
    return sum(1 for e in evs if isinstance(e, HelloEvent) and not e.early)


def errors(evs: list) -> list[ErrorEvent]:
    return [e for e in evs if isinstance(e, ErrorEvent)]


def wait_for(pred, proc: subprocess.Popen | None, timeout: float = 300, poll: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def n_steps(run_dir: Path) -> int:
    try:
        return rundir.RunDir(run_dir).events().read_text().count('"type":"step"')
    except OSError:
        return 0


def tmp_names(run_dir: Path) -> set[str]:
    """The temporary files in checkpoints/: a checkpoint being written (or a killed writer's leftover)."""
    try:
        return {p.name for p in rundir.checkpoint_dir(run_dir).iterdir() if p.name.endswith(".tmp")}
    except OSError:
        return set()


def tmp_in_checkpoints(run_dir: Path) -> bool:
    return bool(tmp_names(run_dir))


def state_of(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def same_state(a: dict, b: dict) -> bool:
    def flat(x, prefix=""):
        if isinstance(x, torch.Tensor):
            yield prefix, x
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                yield from flat(x[k], f"{prefix}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from flat(v, f"{prefix}/{i}")

    ta, tb = dict(flat(a["model"])), dict(flat(b["model"]))
    oa, ob = dict(flat(a["optimizer"]["state"])), dict(flat(b["optimizer"]["state"]))
    return (
        ta.keys() == tb.keys()
        and oa.keys() == ob.keys()
        and all(torch.equal(ta[k], tb[k]) for k in ta)
        and all(torch.equal(oa[k], ob[k]) for k in oa)
    )


def all_checkpoints_load(run_dir: Path) -> tuple[int, list[str]]:
    bad = []
    infos = rundir.list_checkpoints(run_dir)
    for info in infos:
        try:
            ckpt.load(info.path)
        except Exception as e:  # noqa: BLE001 - any failure to load is what this counts
            bad.append(f"{info.path.name}: {e}")
    return len(infos), bad


def all_finite(path: Path) -> bool:
    state = state_of(path)
    tensors = list(state["model"].values()) + [
        v for s in state["optimizer"]["state"].values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


# --------------------------------------------------------------------------- 1. kill -9 and resume


def kill_campaign(work: Path, kills: int, rng: random.Random, max_steps: int, every: int) -> None:
    print(f"kill -9 campaign: {kills} kills, {max_steps} steps, a checkpoint every {every}", flush=True)
    args = [*TINY, "--max-steps", str(max_steps), "--checkpoint-every", str(every), "--keep-checkpoints", "2"]
    ref_dir, run_dir = work / "reference", work / "killed"
    t0 = time.monotonic()
    p = run([*TRAINER, *args, "--run-dir", str(ref_dir)])
    if not check(p.returncode == 0, f"reference run exit {p.returncode}: {p.stderr[-500:]}"):
        return
    reference = dict(step_losses(events(ref_dir)))
    check(sorted(reference) == list(range(1, max_steps + 1)), "reference run logged every step")
    ref_final = state_of(rundir.path_for(ref_dir, max_steps))
    plan = ["checkpoint" if i % 2 == 0 else "random" for i in range(kills)]
    rng.shuffle(plan)
    log = work / "killed.log"
    done_kills, during_write, partial, resumes, segments = 0, 0, 0, 0, []
    lock_refusals = 0
    for i, how in enumerate(plan):
        first = not rundir.has_checkpoint(run_dir)
        cmd = [*TRAINER, *args, "--run-dir", str(run_dir)] if first else [*TRAINER, "--resume", str(run_dir)]
        before, stale = n_steps(run_dir), tmp_names(run_dir)  # a killed writer's leftover is not a write
        proc = start(cmd, log)
        if how == "checkpoint":  # during the k-th checkpoint write of this start (k = 1..3)
            k, seen = rng.randint(1, 3), set()

            def writing() -> bool:
                now = tmp_names(run_dir) - stale
                seen.update(now)
                return len(seen) >= k and bool(now)

            hit = wait_for(writing, proc)
        else:  # at a random moment: 1..4 steps into this start, plus a part of a step
            target = before + rng.randint(1, 4)
            hit = wait_for(lambda: n_steps(run_dir) >= target, proc, poll=0.01)
            if hit:
                time.sleep(rng.uniform(0.0, 0.3))
        alive = proc.poll() is None
        in_write = bool(tmp_names(run_dir) - stale)
        if alive:
            os.kill(proc.pid, signal.SIGKILL)
        code = proc.wait()
        if code == 2:
            lock_refusals += 1
        if alive:
            done_kills += 1
            during_write += how == "checkpoint" and hit and in_write
        n, bad = all_checkpoints_load(run_dir)
        partial += len(bad)
        check(not bad, f"kill {i + 1}: checkpoints that do not load: {bad}")
        resumes += 0 if first else 1
        segments.append({"kill": i + 1, "how": how, "killed": alive, "exit": code, "checkpoints": n})
        print(
            f"  kill {i + 1}/{kills} ({how}): {'killed' if alive else f'exited {code} first'}, "
            f"{n} checkpoints, newest step {rundir.list_checkpoints(run_dir)[-1].step if n else '-'}",
            flush=True,
        )
    p = run([*TRAINER, "--resume", str(run_dir)])
    resumes += 1
    check(p.returncode == 0, f"final resume exit {p.returncode}: {p.stderr[-500:]}")
    logged = step_losses(events(run_dir))
    mismatched = [(s, loss, reference.get(s)) for s, loss in logged if loss != reference.get(s)]
    check(not mismatched, f"losses differing from the reference: {mismatched[:5]}")
    final = rundir.path_for(run_dir, max_steps)
    exact_weights = final.exists() and same_state(state_of(final), ref_final)
    check(exact_weights, "final weights and optimizer state equal the reference's")
    leftovers = [q.name for q in rundir.checkpoint_dir(run_dir).iterdir() if q.name.endswith(".tmp")]
    check(not leftovers, f"temporary files left after the run: {leftovers}")
    results["kill"] = {
        "kills": done_kills,
        "during_checkpoint_write": during_write,
        "random_moment": done_kills - during_write,
        "resumes": resumes,
        "steps_logged": len(logged),
        "steps_rerun": len(logged) - len({s for s, _ in logged}),
        "loss_mismatches": len(mismatched),
        "final_state_exact": exact_weights,
        "partial_checkpoints": partial,
        "lock_refused_after_kill": lock_refusals,
        "tmp_left_at_end": len(leftovers),
        "seconds": round(time.monotonic() - t0, 1),
    }


# --------------------------------------------------------------------------- 2. disk full / read-only


class Tmpfs:
    def __init__(self, where: Path, size: str):
        self.path = where
        self.size = size

    def __enter__(self) -> Path | None:
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)], capture_output=True, text=True
        )
        self.mounted = r.returncode == 0
        return self.path if self.mounted else None

    def __exit__(self, *exc: object) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def disk_checks(work: Path) -> None:
    print("disk full and read-only", flush=True)
    out: dict[str, Any] = {}
    # a) a checkpoint that does not fit
    with Tmpfs(work / "full", "60m") as fs:
        if fs is None:
            results["disk"] = {"skipped": "cannot mount a tmpfs here (needs root)"}
            print("  skipped: cannot mount a tmpfs (needs root)")
            return
        d = fs / "run"
        p = run([*TRAINER, *TINY, "--max-steps", "8", "--checkpoint-every", "2", "--run-dir", str(d)])
        err = (errors(events(d)) or [None])[-1]
        out["checkpoint_full"] = _disk_figures(p.returncode, err, d, expect="No space left on device")
    # b) the disk fills up while events are written, under gptop with --restart-on-failure 3
    with Tmpfs(work / "events", "80m") as fs:
        d = fs / "run"
        gptop = start(
            [
                *GPTOP,
                "train",
                *TINY,
                "--max-steps",
                "400",
                "--checkpoint-every",
                "0",
                "--run-dir",
                str(d),
                "--restart-on-failure",
                "3",
            ],
            work / "events-gptop.log",
        )
        ok = wait_for(lambda: n_steps(d) >= 2, gptop, poll=0.05)
        filler = fs / "filler"
        if ok:
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)
        code = gptop.wait(600)
        text = (work / "events-gptop.log").read_text(errors="replace")
        starts = n_starts(events(d))
        said = next((line for line in reversed(text.splitlines()) if line.startswith("gptop: ")), "")
        out["events_full"] = {
            "exit": code,
            "starts": starts,
            "gptop_says": said[:240],
            "disk_error_named": "No space left on device" in said,
        }
        check(
            code == 1 and starts == 1 and "No space left on device" in said,
            f"a full disk under events: gptop exit {code}, {starts} starts, said {said!r}; log: {text[-1500:]}",
        )
        print(f"  {out['events_full']}", flush=True)
    # c) the checkpoint directory turns read-only mid-run (a read-only bind mount over it, between two saves:
    # a filesystem with files open for writing cannot be remounted read-only as a whole)
    d = work / "ro" / "run"
    ckdir = rundir.checkpoint_dir(d)
    proc = start(
        [*TRAINER, *TINY, "--max-steps", "400", "--checkpoint-every", "3", "--run-dir", str(d)], work / "ro.log"
    )
    mounted = False
    if wait_for(lambda: rundir.has_checkpoint(d) and not tmp_in_checkpoints(d), proc, poll=0.01):
        mounted = subprocess.run(["mount", "--bind", str(ckdir), str(ckdir)], capture_output=True).returncode == 0
        ro = (
            mounted
            and subprocess.run(["mount", "-o", "remount,bind,ro", str(ckdir)], capture_output=True).returncode == 0
        )
        if not ro:
            os.kill(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(600)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckdir)], capture_output=True)
    said = next(
        (line for line in (work / "ro.log").read_text(errors="replace").splitlines() if "error (disk)" in line), ""
    )
    n, bad = all_checkpoints_load(d)
    out["read_only"] = {
        "exit": code,
        "stderr_says": said[:240],
        "checkpoints": n,
        "corrupt": len(bad),
        "tmp_left": tmp_in_checkpoints(d),
    }
    check(
        code == 8 and "Read-only file system" in said and n >= 1 and not bad and not tmp_in_checkpoints(d),
        f"read-only mid-run: exit {code}, {said!r}, {n} checkpoints, {bad}",
    )
    results["disk"] = out


def _disk_figures(code: int, err: ErrorEvent | None, d: Path, expect: str) -> dict:
    n, bad = all_checkpoints_load(d)
    tmp = [q.name for q in d.rglob("*.tmp")]
    fig = {
        "exit": code,
        "kind": err.kind if err else None,
        "os_error": err.os_error if err else None,
        "path": err.path if err else None,
        "free_bytes": err.free_bytes if err else None,
        "checkpoints_intact": n - len(bad),
        "tmp_left": len(tmp),
        "message": err.message if err else None,
    }
    check(
        code == 8
        and err is not None
        and err.kind == "disk"
        and err.os_error == expect
        and n >= 1
        and not bad
        and not tmp,
        f"disk full: {fig}",
    )
    print(f"  {fig}", flush=True)
    return fig


# --------------------------------------------------------------------------- 3. NaN cases


def nan_checks(work: Path) -> None:
    print("NaN cases", flush=True)
    out = {}
    for name, extra in (
        ("lr_1e4", ["--lr", "1e4", "--warmup-steps", "0", "--checkpoint-every", "1"]),
        ("lr_inf", ["--lr", "inf"]),
    ):
        d = work / f"nan-{name}"
        base = [a for a in TINY if a not in ()]
        i = base.index("--warmup-steps")
        base = base[:i] + base[i + 2 :]
        p = run([*GPTOP, "train", *base, "--max-steps", "30", *extra, "--run-dir", str(d)])
        infos = rundir.list_checkpoints(d) if d.exists() else []
        finite = [all_finite(c.path) for c in infos]
        err = (errors(events(d)) or [None])[-1] if d.exists() else None
        rollbacks = (
            sum(1 for e in events(d) if e.type == "warning" and getattr(e, "kind", None) == "nan_rollback")
            if d.exists()
            else 0
        )
        outcome = (
            "refused (exit 2)"
            if p.returncode == 2
            else "recovered"
            if p.returncode == 0
            else f"stopped: {err.kind}"
            if err
            else f"exit {p.returncode}"
        )
        out[name] = {
            "exit": p.returncode,
            "outcome": outcome,
            "checkpoints": len(infos),
            "all_finite": all(finite),
            "rollbacks": rollbacks,
            "said": (p.stderr.strip().splitlines() or [""])[-1][:200],
        }
        check(
            all(finite) and (p.returncode in (0, 2) or (err is not None and err.kind == "nan")),
            f"NaN case {name}: {out[name]}",
        )
        print(f"  {name}: {out[name]}", flush=True)
    results["nan"] = out


# --------------------------------------------------------------------------- 4. two writers


def two_writers(work: Path) -> None:
    print("two writers on one run directory", flush=True)
    d = work / "shared"
    first = start(
        [*GPTOP, "train", *TINY, "--max-steps", "12", "--checkpoint-every", "4", "--run-dir", str(d)],
        work / "first.log",
    )
    wait_for(lambda: n_steps(d) >= 1, first, poll=0.05)
    second = []
    for cmd in (
        [*GPTOP, "train", *TINY, "--max-steps", "12", "--run-dir", str(d)],
        [*TRAINER, *TINY, "--max-steps", "12", "--run-dir", str(d)],
    ):
        t = time.monotonic()
        p = run(cmd)
        second.append(
            {
                "exit": p.returncode,
                "seconds": round(time.monotonic() - t, 2),
                "said": p.stderr.strip().splitlines()[-1][:240] if p.stderr.strip() else "",
            }
        )
    code = first.wait(600)
    evs = events(d)
    steps = [e.step for e in evs if isinstance(e, StepEvent)]
    ok = (
        code == 0
        and all(s["exit"] == 2 and f"pid {first.pid} on host {socket.gethostname()}" in s["said"] for s in second)
        and n_starts(evs) == 1
        and steps == list(range(1, 13))
    )
    check(ok, f"two writers: first exit {code}, refused {second}, steps {steps}")
    results["two_writers"] = {
        "first_exit": code,
        "refused": second,
        "hello_events": n_starts(evs),
        "steps_in_order": steps == list(range(1, 13)),
    }
    for s in second:
        print(f"  refused: exit {s['exit']} in {s['seconds']} s: {s['said']}", flush=True)


# --------------------------------------------------------------------------- 5. export --force and run reuse


def tree(d: Path) -> dict[str, int]:
    """Every file under `d` with its size (what must not change)."""
    return {str(q.relative_to(d)): q.stat().st_size for q in sorted(d.rglob("*")) if q.is_file()} if d.exists() else {}


def export_checks(work: Path) -> None:
    """`gptop export --force` aimed at what it must never destroy (issue 28 §1): a live run, a finished run's
    checkpoints/, a folder holding runs, the current directory, a symlink to a live run, a directory with files
    export did not write; an earlier export it may replace; a kill -9 of the export worker; and a new run in a
    copied run directory (§2). Each refusal: exit 2, before anything loads, nothing changed."""
    print("export --force and run-directory reuse", flush=True)
    runs = work / "runs"
    base, live = runs / "base", runs / "live"
    p = run([*TRAINER, *TINY, "--max-steps", "4", "--checkpoint-every", "2", "--run-dir", str(base)])
    if not check(p.returncode == 0, f"base run exit {p.returncode}: {p.stderr[-500:]}"):
        return
    trainer = start(
        [*TRAINER, *TINY, "--max-steps", "100000", "--checkpoint-every", "5", "--run-dir", str(live)], work / "live.log"
    )
    if not check(wait_for(lambda: rundir.has_checkpoint(live), trainer, poll=0.05), "the live run checkpoints"):
        trainer.kill()
        return
    (work / "D").mkdir()
    (work / "links").mkdir()
    (work / "links" / "live").symlink_to(live)
    mine = work / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    cases = {
        "live run": str(live),
        "finished run's checkpoints/": str(base / "checkpoints"),
        "a checkpoint's folder inside": str(base / "checkpoints" / "new"),
        "folder holding runs": str(runs) + "/",
        "the current directory": ".",
        "symlink to the live run": str(work / "links" / "live"),
        "a directory export did not write": str(mine),
        "finished run via ..": str(runs / "live" / ".." / "base"),
    }
    refused = {}
    for name, out in cases.items():
        before = {d: tree(d) for d in (base, mine)}
        t = time.monotonic()
        r = subprocess.run(
            [*GPTOP, "export", str(base), out, "--force"],
            capture_output=True,
            text=True,
            env=ENV,
            cwd=work / "D" if out == "." else ROOT,
            timeout=300,
        )
        said = (r.stderr.strip().splitlines() or [""])[-1]
        intact = (
            all(tree(d) == v for d, v in before.items()) and trainer.poll() is None and (live / "config.toml").is_file()
        )
        refused[name] = {
            "exit": r.returncode,
            "seconds": round(time.monotonic() - t, 2),
            "said": said[:200],
            "loaded_nothing": "loading" not in r.stderr,
            "intact": intact,
        }
        check(
            r.returncode == 2 and "OUT_DIR" in said and "loading" not in r.stderr and intact,
            f"export --force into {name}: {refused[name]}",
        )
        print(f"  {name}: exit {r.returncode} in {refused[name]['seconds']} s: {said[:150]}", flush=True)
    os.kill(trainer.pid, signal.SIGTERM)
    live_exit = trainer.wait(300)
    live_ok = live_exit == 0 and all_checkpoints_load(live)[1] == [] and rundir.has_checkpoint(live)
    check(live_ok, f"the live run went on and stopped cleanly (exit {live_exit})")
    # an earlier export may be replaced; a kill -9 of the worker leaves it as it was and its debris is cleaned next time
    out = work / "exports" / "base"
    first = run([*GPTOP, "export", str(base), str(out)])
    again = run([*GPTOP, "export", str(base), str(out), "--force"])
    check(
        first.returncode == 0 and again.returncode == 0,
        f"export and replace: {first.stderr[-300:]} {again.stderr[-300:]}",
    )
    before = tree(out)
    proc = subprocess.Popen(
        [*GPTOP, "export", str(base), str(out), "--force"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    hit = wait_for(lambda: list(out.parent.glob(".base.export-*")), proc, poll=0.01)
    if hit:
        import psutil

        for c in psutil.Process(proc.pid).children(recursive=True):
            c.kill()
    _, err = proc.communicate(timeout=300)
    said = (err.strip().splitlines() or [""])[-1]
    debris = [q.name for q in out.parent.glob(".base.*")]
    after = run([*GPTOP, "export", str(base), str(out), "--force"])
    killed = {
        "exit": proc.returncode,
        "said": said[:200],
        "previous_export_intact": tree(out) == before if hit else None,
        "debris_after_kill": len(debris),
        "next_export_exit": after.returncode,
        "debris_after_next": len(list(out.parent.glob(".base.*"))),
    }
    check(
        not hit
        or (
            proc.returncode == 1
            and "killed by signal 9" in said
            and killed["previous_export_intact"]
            and after.returncode == 0
            and killed["debris_after_next"] == 0
        ),
        f"killed export: {killed}",
    )
    print(f"  kill -9 of the export worker: {killed}", flush=True)
    # a new run in a copy of a run directory
    import shutil

    reuse = runs / "reuse"
    shutil.copytree(base, reuse)
    before = tree(reuse)
    r = run([*GPTOP, "train", *TINY, "--max-steps", "3", "--run-dir", str(reuse)])
    said = (r.stderr.strip().splitlines() or [""])[-1]
    reused = {"exit": r.returncode, "said": said[:200], "intact": tree(reuse) == before}
    check(r.returncode == 2 and "holds another run" in said and reused["intact"], f"reused run directory: {reused}")
    print(f"  new run in a copied run directory: {reused}", flush=True)
    results["export"] = {
        "refused": refused,
        "live_run_exit": live_exit,
        "live_run_ok": live_ok,
        "replace_earlier_export": again.returncode,
        "killed_worker": killed,
        "reused_run_dir": reused,
    }


# --------------------------------------------------------------------------- main


def machine() -> str:
    from trainer.contract.device import cpu_name

    cpu = cpu_name()
    return f"{cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--checkpoint-every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("kill", "disk", "nan", "writers", "export"), action="append")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object at the end")
    ns = ap.parse_args()
    only = set(ns.only or ("kill", "disk", "nan", "writers", "export"))
    print(
        f"bench/faults.py, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {machine()}, "
        f"torch {torch.__version__}, seed {ns.seed}",
        flush=True,
    )
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gptop-faults-") as tmp:
        work = Path(tmp)
        if "kill" in only:
            kill_campaign(work, ns.kills, random.Random(ns.seed), ns.steps, ns.checkpoint_every)
        if "disk" in only:
            disk_checks(work)
        if "nan" in only:
            nan_checks(work)
        if "writers" in only:
            two_writers(work)
        if "export" in only:
            export_checks(work)
    results["seconds"] = round(time.monotonic() - t0, 1)
    results["failures"] = failures
    k = results.get("kill")
    print("\nsummary")
    if k:
        print(
            f"  kill -9: {k['kills']} kills ({k['during_checkpoint_write']} during a checkpoint write, "
            f"{k['random_moment']} at random moments), {k['resumes']} resumes: {k['steps_logged']} step losses "
            f"({k['steps_rerun']} re-run after a resume), {k['loss_mismatches']} differ from the reference; final "
            f"weights and optimizer state {'equal' if k['final_state_exact'] else 'DIFFER'}; "
            f"{k['partial_checkpoints']} partial checkpoints; {k['lock_refused_after_kill']} stale-lock refusals"
        )
    for key, fig in (results.get("disk") or {}).items():
        print(f"  disk {key}: {fig}")
    for key, fig in (results.get("nan") or {}).items():
        print(
            f"  nan {key}: {fig['outcome']}, {fig['checkpoints']} checkpoints, all finite: {fig['all_finite']}, "
            f"{fig['rollbacks']} rollbacks"
        )
    w = results.get("two_writers")
    if w:
        print(
            f"  two writers: the first ran to exit {w['first_exit']} alone ({w['hello_events']} start, steps in "
            f"order: {w['steps_in_order']}); the others exited {[s['exit'] for s in w['refused']]} in "
            f"{[s['seconds'] for s in w['refused']]} s"
        )
    x = results.get("export")
    if x:
        r = x["refused"]
        print(
            f"  export --force: {sum(v['exit'] == 2 and v['intact'] for v in r.values())}/{len(r)} protected paths "
            f"refused with exit 2 and nothing changed, in {min(v['seconds'] for v in r.values())}-"
            f"{max(v['seconds'] for v in r.values())} s, none loading anything: "
            f"{all(v['loaded_nothing'] for v in r.values())}; the live run exited {x['live_run_exit']}; an earlier "
            f"export replaced: exit {x['replace_earlier_export']}; killed worker: {x['killed_worker']}; reused run "
            f"directory: exit {x['reused_run_dir']['exit']}"
        )
    print(f"  {len(failures)} failed checks, {results['seconds']} s")
    if ns.json:
        print(json.dumps(results, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
