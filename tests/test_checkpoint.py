import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer import checkpoint_files as ckpt

from trainer.contract import rundir


def state(step):
    return {"step": step, "model": {"w": torch.full((4,), float(step))}, "optimizer": {}, "config": {"x": 1}}


def test_save_load_and_prune(tmp_path):
    for s in (10, 20, 30, 40):
        ckpt.save(state(s), rundir.path_for(tmp_path, s))
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [10, 20, 30, 40]
    rundir.prune(tmp_path, keep=2)
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [30, 40]
    path, st = ckpt.resolve_resume(tmp_path)
    assert st["step"] == 40 and path.name == "step-00000040.pt"


def test_corrupt_checkpoint_falls_back_and_is_named(tmp_path):
    for s in (1, 2, 3):
        ckpt.save(state(s), rundir.path_for(tmp_path, s))
    newest = rundir.path_for(tmp_path, 3)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    garbage = rundir.path_for(tmp_path, 4)
    garbage.write_bytes(b"not a checkpoint")
    reports = []
    path, st = ckpt.resolve_resume(tmp_path, on_corrupt=reports.append)
    assert st["step"] == 2
    assert len(reports) == 2 and "step-00000004.pt" in reports[0] and "step-00000003.pt" in reports[1]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "zip garbage", "empty"])
def test_a_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path, damage):
    """torch's own advice ("This is an internal miniz error...", "Please file an issue...") stays out of
    the message; the whole error stays on the exception's chain (for a log's traceback)."""
    p = rundir.path_for(tmp_path, 5)
    ckpt.save(state(5), p)
    data = p.read_bytes()
    p.write_bytes(
        {
            "truncated": data[: len(data) // 2],
            "garbage": b"not a checkpoint",
            "empty": b"",
            "zip garbage": b"PK\x03\x04" + b"\x00" * 64,
        }[damage]
    )
    with pytest.raises(ckpt.CorruptCheckpoint) as e:
        ckpt.load(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(p)) and len(msg) < 400, msg
    assert "Please file an issue" not in msg and "internal miniz error" not in msg and "weights_only" not in msg
    assert e.value.__cause__ is not None


def test_all_corrupt_is_an_error(tmp_path):
    p = rundir.path_for(tmp_path, 1)
    p.parent.mkdir(parents=True)
    p.write_bytes(b"x")
    with pytest.raises(ckpt.CorruptCheckpoint):
        ckpt.resolve_resume(tmp_path)


def test_missing_keys_detected(tmp_path):
    p = rundir.path_for(tmp_path, 1)
    ckpt.save({"step": 1}, p)
    with pytest.raises(ckpt.CorruptCheckpoint, match="missing"):
        ckpt.load(p)


@pytest.mark.process
def test_kill_during_save_leaves_previous_intact(tmp_path):
    """SIGKILL a process in the middle of writing a large checkpoint: the old one still loads."""
    ckpt.save(state(1), rundir.path_for(tmp_path, 1))
    script = textwrap.dedent(f"""
        import os, sys, torch
        from trainer import checkpoint_files as ckpt
        from trainer.contract import rundir
        big = {{"step": 2, "model": {{"w": torch.randn(64 * 2**20 // 4 * 8)}}, "optimizer": {{}}, "config": {{}}}}
        real_save = torch.save
        def slow_save(obj, f):
            f.write(b"partial bytes")
            f.flush()
            sys.stdout.write("writing\\n"); sys.stdout.flush()
            import time; time.sleep(30)
        torch.save = slow_save
        ckpt.save(big, rundir.path_for({str(tmp_path)!r}, 2))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step-00000002.pt" not in names and any(n.endswith(".tmp") for n in names)
    path, st = ckpt.resolve_resume(tmp_path)
    assert st["step"] == 1
    rundir.prune(tmp_path, keep=3)  # the dead writer's temp file is cleaned up
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())
