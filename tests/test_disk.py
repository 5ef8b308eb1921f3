"""Disk full and read-only filesystems (issue 10 §4): a `disk` error naming the path, the errno text and the
free bytes, exit 8, the previous checkpoint intact, no temporary file left, no crash loop.

Two ways: failing the write at its one boundary (trainer.contract.atomic, the event channel), which runs
everywhere; and a real small tmpfs (or a read-only bind mount), where the tests run as root."""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from helpers import ROOT, TINY, gptop_cmd, restoring_signals, train_in_process, trainer_cmd
from trainer import checkpoint_files as ckpt
from trainer.channel import Channel
from trainer.worker_cli import parse_config
from trainer.contract import atomic, rundir
from trainer.contract.atomic import DiskError, atomic_write, disk_error
from trainer.contract.events import ErrorEvent, HelloEvent, read_events
from trainer.runner import main_run
from trainer.train import EXIT_DISK

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


class FailingFile:
    """A file whose writes fail with `err` once `budget` bytes were written (a filesystem filling up)."""

    def __init__(self, f, err: int, budget: int):
        self.f, self.err, self.budget = f, err, budget

    def write(self, data):
        if len(data) > self.budget:
            raise OSError(self.err, os.strerror(self.err))
        self.budget -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fail_writes(monkeypatch, err: int = errno.ENOSPC, budget: int = 0, only=lambda path: True):
    """Make atomic writes of the paths `only` accepts fail with `err` after `budget` bytes."""
    real_open = builtins.open

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return FailingFile(f, err, budget) if "w" in mode and only(str(path)) else f

    monkeypatch.setattr(atomic, "open", fake_open, raising=False)


def tmp_files(d):
    return [p for p in d.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "err,text", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")]
)
def test_a_failed_atomic_write_names_path_errno_and_free_space_and_keeps_the_old_file(tmp_path, monkeypatch, err, text):
    target = tmp_path / "config.toml"
    target.write_text("old\n")
    fail_writes(monkeypatch, err)
    with pytest.raises(DiskError) as e:
        atomic_write(target, "new\n" * 1000)
    assert e.value.path == str(target) and e.value.strerror == text and e.value.errno == err
    assert isinstance(e.value.free_bytes, int) and e.value.free_bytes >= 0
    assert text in str(e.value) and str(target) in str(e.value) and "free there" in str(e.value)
    assert e.value.read_only == (err == errno.EROFS)
    assert target.read_text() == "old\n" and tmp_files(tmp_path) == []


def test_torch_save_swallowing_the_oserror_is_still_a_disk_error(tmp_path, monkeypatch):
    """torch.save turns a failed write into 'RuntimeError: ... unexpected pos'; the boundary sees through it."""
    path = rundir.path_for(tmp_path, 2)
    ckpt.save({"step": 2, "model": {"w": torch.ones(3)}, "optimizer": {}, "config": {}}, path)
    fail_writes(monkeypatch, budget=1000)
    with pytest.raises(DiskError, match="No space left on device") as e:
        ckpt.save(
            {"step": 4, "model": {"w": torch.randn(100_000)}, "optimizer": {}, "config": {}},
            rundir.path_for(tmp_path, 4),
        )
    assert e.value.path == str(rundir.path_for(tmp_path, 4))
    assert isinstance(e.value.__cause__, RuntimeError)  # what torch raised
    assert ckpt.load(path)["step"] == 2 and tmp_files(tmp_path) == []
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [2]


def test_disk_error_finds_the_cause_in_chains_and_dcp_failures():
    class CheckpointException(Exception):  # torch.distributed.checkpoint's: per-rank (exception, traceback)
        def __init__(self, failures):
            self.failures = failures

    full = OSError(errno.ENOSPC, "No space left on device", "/x/__0_0.distcp")
    assert disk_error(CheckpointException({1: (full, None)})).path == "/x/__0_0.distcp"
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as e:
        assert disk_error(e, "/y").read_only
    assert disk_error(RuntimeError("other")) is None
    assert disk_error(OSError(errno.ENOENT, "No such file or directory")) is None


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_events_file_does_not_raise_and_stops_the_run_once():
    ch = Channel(Path("/dev/full"))  # every write: No space left on device
    ch.emit("log", message="lost")  # no exception: an event is not a crash
    ch.emit("log", message="also lost")
    assert isinstance(ch.write_error, DiskError) and ch.write_error.path == "/dev/full"
    assert ch.write_error.strerror == "No space left on device"
    ch.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_run_whose_events_cannot_be_written_stops_with_a_disk_error(tmp_path, capfd):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").symlink_to("/dev/full")
    with restoring_signals():  # the events file is /dev/full: nothing to read back
        code = main_run(parse_config([*TINY, "--run-dir", str(tmp_path / "run"), "--max-steps", "50"]))
    assert code == EXIT_DISK
    err = capfd.readouterr().err
    assert "error (disk): No space left on device: cannot write" in err and "events.jsonl" in err
    assert not rundir.list_checkpoints(tmp_path / "run")  # stopped at the first step boundary


def _run(tmp_path, *args):
    return train_in_process(tmp_path / "run", *args, strict=False)


def test_a_checkpoint_on_a_full_disk_is_a_disk_error_and_the_previous_one_stays(tmp_path, monkeypatch):
    fail_writes(monkeypatch, budget=4096, only=lambda p: "step-00000004" in p)
    code, events, run_dir = _run(tmp_path, "--max-steps", "6", "--checkpoint-every", "2")
    assert code == EXIT_DISK == 8
    err = [e for e in events if isinstance(e, ErrorEvent)][-1]
    assert err.kind == "disk" and err.exit_code == 8 and err.step == 4
    assert err.path == str(rundir.path_for(run_dir, 4)) and err.os_error == "No space left on device"
    assert isinstance(err.free_bytes, int)
    assert "step-00000002.pt is intact" in err.message and f"--resume {run_dir}" in err.message
    assert [c.step for c in rundir.list_checkpoints(run_dir)] == [2] and tmp_files(run_dir) == []
    assert ckpt.load(rundir.path_for(run_dir, 2))["step"] == 2


# --- real filesystems (root) ------------------------------------------------------------------------------


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({r.stderr.strip() or r.returncode}); the boundary tests above cover it")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 60 MiB tmpfs: room for one tiny-model checkpoint (34 MiB), not two."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    _mount("-t", "tmpfs", "-o", "size=60m", "tmpfs", str(d))
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.process
@pytest.mark.slow
def test_gptop_on_a_full_tmpfs_says_why_and_does_not_restart(small_tmpfs):
    run_dir = small_tmpfs / "run"
    p = subprocess.run(
        gptop_cmd(
            "--no-ui",
            "train",
            *TINY,
            "--max-steps",
            "6",
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(run_dir),
            "--restart-on-failure",
            "3",
        ),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert p.returncode == 1, p.stderr
    assert "disk: No space left on device: cannot write" in p.stderr and "step-00000004.pt" in p.stderr
    events = list(read_events(run_dir / "events.jsonl"))
    starts = [e for e in events if isinstance(e, HelloEvent) and not e.early]
    assert len(starts) == 1  # no restart into the same full disk
    err = [e for e in events if isinstance(e, ErrorEvent)][-1]
    assert err.kind == "disk" and err.exit_code == 8 and err.free_bytes < 34 << 20
    assert [c.step for c in rundir.list_checkpoints(run_dir)] == [2] and tmp_files(run_dir) == []
    assert "Traceback" in rundir.RunDir(run_dir).trainer_stderr.read_text()  # the traceback is in the log only
    assert "Traceback" not in p.stderr


@pytest.mark.process
@pytest.mark.slow
def test_a_read_only_checkpoint_directory_is_a_disk_error(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    code, _, run_dir = train_in_process(tmp_path / "run", "--max-steps", "2")  # the run to resume: no process needed
    assert code == 0
    d = rundir.checkpoint_dir(run_dir)
    _mount("--bind", str(d), str(d))
    try:
        _mount("-o", "remount,bind,ro", str(d))
        p = subprocess.run(
            trainer_cmd("--resume", str(run_dir), "--max-steps", "4"),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=600,
        )
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
    assert p.returncode == EXIT_DISK, p.stderr
    err = [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, ErrorEvent)][-1]
    assert err.kind == "disk" and err.os_error == "Read-only file system"
    assert err.path == str(rundir.path_for(run_dir, 4)) and "make it writable" in err.message.lower()
    assert [c.step for c in rundir.list_checkpoints(run_dir)] == [2] and tmp_files(run_dir) == []
    assert isinstance(err.free_bytes, int)


@pytest.mark.process
@pytest.mark.slow
def test_two_ranks_on_a_full_tmpfs_name_the_disk_and_leave_no_partial_sharded_checkpoint(small_tmpfs):
    run_dir = small_tmpfs / "run"
    p = subprocess.run(
        gptop_cmd(
            "--no-ui",
            "train",
            "--nproc",
            "2",
            *TINY,
            "--max-steps",
            "6",
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(run_dir),
        ),
        capture_output=True,
        text=True,
        env={**ENV, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "disk: No space left on device" in p.stderr, p.stderr[-3000:]
    errors = [
        e
        for r in (0, 1)
        if rundir.RunDir(run_dir).events(r).exists()
        for e in read_events(rundir.RunDir(run_dir).events(r))
        if isinstance(e, ErrorEvent)
    ]
    assert any(e.kind == "disk" and e.exit_code == EXIT_DISK for e in errors)
    assert [c.step for c in rundir.list_checkpoints(run_dir)] == [2]
    assert not list(rundir.checkpoint_dir(run_dir).glob("*.tmp")) and tmp_files(run_dir) == []
    assert ckpt.load(rundir.dcp_path_for(run_dir, 2))["step"] == 2
