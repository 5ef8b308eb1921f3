"""One writer per run directory (issue 10 §3): an OS lock, refused writers exit 2 naming the holder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from helpers import ROOT, TINY, gptop_cmd, trainer_cmd, wait_for
from trainer.contract import rundir
from trainer.contract.runlock import LOCK_NODE_ENV, LOCK_TOKEN_ENV, RunDirBusy, RunDirTaken, RunLock

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HOLD = (
    "import sys, time\nfrom trainer.contract.runlock import RunLock\n"
    "lock = RunLock.acquire(sys.argv[1], command='holder')\nprint('locked', flush=True)\ntime.sleep(600)\n"
)


def test_a_second_writer_is_refused_naming_pid_and_host(tmp_path):
    with RunLock.acquire(tmp_path / "run", command="gptop train") as lock:
        assert lock.held
        with pytest.raises(RunDirBusy) as e:
            RunLock.acquire(tmp_path / "run", command="python -m trainer")
        msg = str(e.value)
        assert e.value.option == "--run-dir"
        assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and "gptop train" in msg
    RunLock.acquire(tmp_path / "run", command="again").release()  # released: free again


def test_the_owners_token_lets_its_children_in(tmp_path, monkeypatch):
    with RunLock.acquire(tmp_path, command="gptop train") as lock:
        monkeypatch.setenv(LOCK_TOKEN_ENV, lock.token)
        monkeypatch.setenv(LOCK_NODE_ENV, "")
        child = RunLock.for_trainer(tmp_path)  # the trainer gptop started
        assert not child.held
        monkeypatch.setenv(LOCK_TOKEN_ENV, "someone-else")
        with pytest.raises(RunDirBusy):
            RunLock.for_trainer(tmp_path)


def test_ranks_of_one_torchrun_share_the_lock_and_another_torchrun_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    for k, v in {"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    rank0 = RunLock.for_trainer(tmp_path)
    rank1 = RunLock.for_trainer(tmp_path)  # same host, same torchrun agent (parent pid)
    assert rank0.held and not rank1.held
    monkeypatch.setattr(os, "getppid", lambda: 1)  # another torchrun's rank
    with pytest.raises(RunDirBusy, match="python -m trainer"):
        RunLock.for_trainer(tmp_path)
    rank0.release()


def test_the_second_rank_of_a_new_torchrun_run_is_not_refused_by_its_sibling(tmp_path, monkeypatch):
    """Rank 0 took the lock and wrote its first events before rank 1 checks the directory: a sibling, not a
    second run (both ranks ask for a new run)."""
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    for k, v in {"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    rank0 = RunLock.for_trainer(run, new_run=True)
    (run / "events.jsonl").write_text(json.dumps({"kind": "hello", "step": 0}) + "\n")
    rank1 = RunLock.for_trainer(run, new_run=True)
    assert rank0.held and not rank1.held
    monkeypatch.setattr(os, "getppid", lambda: 1)  # another torchrun's rank
    with pytest.raises(RunDirBusy, match="python -m trainer"):
        RunLock.for_trainer(run, new_run=True)
    rank0.release()


def test_multi_node_runs_lock_per_node(tmp_path):
    node0 = RunLock.acquire(tmp_path, command="gptop train", node="node0")
    node1 = RunLock.acquire(tmp_path, command="gptop train", node="node1")  # nodes share the directory
    assert (tmp_path / ".gptop.lock.node0").is_file() and (tmp_path / ".gptop.lock.node1").is_file()
    with pytest.raises(RunDirBusy, match="node node1"):
        RunLock.acquire(tmp_path, command="gptop train", node="node1")  # a second run's node 1
    with pytest.raises(RunDirBusy, match="multi-node run"):
        RunLock.acquire(tmp_path, command="gptop train")  # a one-node run
    node0.release()
    node1.release()
    with RunLock.acquire(tmp_path, command="gptop train") as single:  # all gone: free
        with pytest.raises(RunDirBusy, match="gptop train"):
            RunLock.acquire(tmp_path, command="gptop train", node="node0")  # and the reverse
        assert single.held


def test_each_node_writes_its_own_files(tmp_path):
    one, node = rundir.RunDir(tmp_path), rundir.RunDir(tmp_path, "node1")
    assert one.trainer_log.name == "trainer.log" and node.trainer_log.name == "trainer.node1.log"
    assert node.trainer_stderr.name == "trainer.node1.stderr.log" and node.device.name == "device.node1.jsonl"
    assert node.events(0) == one.events(0) and node.config == one.config and node.checkpoints == one.checkpoints


@pytest.mark.process
@pytest.mark.slow
def test_the_lock_is_released_by_kill_9(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy, match=f"pid {p.pid} "):
            RunLock.acquire(tmp_path, command="second")
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with RunLock.acquire(tmp_path, command="after the kill") as lock:  # no stale pid file to clean up
        assert lock.held
        assert json.loads((tmp_path / ".gptop.lock").read_text())["command"] == "after the kill"


@pytest.mark.process
@pytest.mark.slow
def test_trainer_and_gptop_refuse_a_run_dir_in_use_before_writing_anything(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock.acquire(run_dir, command="gptop train"):
        args = [*TINY, "--max-steps", "2", "--run-dir", str(run_dir)]
        for cmd in (trainer_cmd(*args), gptop_cmd("--no-ui", "train", *args)):
            p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
            assert p.returncode == 2, p.stderr
            assert f"pid {os.getpid()} on host {socket.gethostname()}" in p.stderr and "--run-dir" in p.stderr
            assert "Traceback" not in p.stderr
        assert sorted(x.name for x in run_dir.iterdir()) == [".gptop.lock"]  # nothing written, nothing started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.process
@pytest.mark.slow
def test_a_multi_node_run_shares_the_directory_and_keeps_out_a_one_node_run(tmp_path):
    """Two nodes on this machine (static rendezvous, one rank each) train into one run directory; each node
    writes its own logs and device samples; a one-node run started meanwhile is refused."""
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "--max-steps",
        "4",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(run_dir),
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-backend",
        "static",
    ]
    gptop = gptop_cmd("--no-ui", "train")
    nodes = [
        subprocess.Popen(
            [*gptop, *args, "--node-rank", str(n)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for n in (0, 1)
    ]
    try:

        def both_locked():
            assert all(p.poll() is None for p in nodes), "a node exited before taking its lock"
            return all(rundir_record(run_dir / f".gptop.lock.node{n}") for n in (0, 1))

        wait_for(both_locked, 60, "both nodes' lock records", poll=0.1)
        single = subprocess.run(
            [*gptop, *TINY, "--max-steps", "2", "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
        assert single.returncode == 2 and "multi-node run" in single.stderr, single.stderr
        for p in nodes:
            assert p.wait(300) == 0, p.stderr.read()
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [c.step for c in rundir.list_checkpoints(run_dir)] == [2, 4]
    for n in (0, 1):
        assert rundir.RunDir(run_dir, f"node{n}").trainer_log.is_file()
        assert rundir.RunDir(run_dir, f"node{n}").device.stat().st_size > 0
    assert not (run_dir / "trainer.log").exists() and not (run_dir / "device.jsonl").exists()


def rundir_record(path) -> dict | None:
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None


# --- one run per run directory ----------------------------------------------------------------------------


def old_run(path, *, events: bool = True, steps=(8, 16)):
    """What a finished run leaves (as `cp -r runs/a runs/reuse` copies it): config, events, checkpoints, lock."""
    from trainer.worker_cli import parse_config

    (path / "checkpoints").mkdir(parents=True)
    (path / "config.toml").write_text(parse_config([*TINY, "--run-dir", str(path)]).to_toml())
    if events:
        (path / "events.jsonl").write_text('{"v": 1, "type": "hello", "time": 0, "rank": 0}\n')
    for s in steps:
        rundir.path_for(path, s).write_bytes(b"PK\x03\x04 not really")
    (path / ".gptop.lock").write_text("")
    return path


def tree(path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize(
    "events, steps, hint",
    [(True, (8, 16), "--resume"), (False, (16,), "--resume"), (True, (), "choose another --run-dir")],
)
def test_a_new_run_in_a_directory_holding_another_run_is_refused(tmp_path, events, steps, hint):
    run = old_run(tmp_path / "reuse", events=events, steps=steps)
    (run / ".gptop.lock").unlink()
    before = tree(run)
    with pytest.raises(RunDirTaken) as e:
        RunLock.acquire(run, command="gptop train", new_run=True)
    assert e.value.option == "--run-dir" and "holds another run" in e.value.message and hint in e.value.message
    if steps:
        assert f"up to step {steps[-1]}" in e.value.message
    assert tree(run) == before  # not even a lock file
    RunLock.acquire(run, command="gptop train --resume").release()  # resuming it is fine


def test_a_directory_without_another_runs_events_or_checkpoints_takes_a_new_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("")  # empty: nothing to mix with
    (run / "device.jsonl").write_text("{}\n")
    (run / "trainer.node1.stderr.log").write_text("")
    (run / ".hidden").write_text("")
    (run / "tuner-checkpoints").mkdir()  # gptop's own (gptop.held_checkpoints)
    RunLock.acquire(run, command="gptop train", new_run=True).release()
    RunLock.acquire(tmp_path / "new", command="gptop train", new_run=True).release()
    (run / "notes.txt").write_text("mine")  # a user's file: not a run's directory
    with pytest.raises(RunDirTaken, match=r"holds files that are not a run's \(notes.txt\)"):
        RunLock.acquire(run, command="gptop train", new_run=True)


def user_folder(path):
    """A folder of a user's own files (a project), as `--run-dir .` would give."""
    (path / "data").mkdir(parents=True)
    (path / "train.py").write_text("print('mine')\n")
    (path / "data" / "corpus.txt").write_text("text\n")
    return path


# Every command that takes --run-dir for a new run, each refused before anything starts (cli.main in this
# process: a process started by mistake fails the test, tests/conftest.py).
NEW_RUNS = {  # the command's words, and whether a program follows them after --
    "train": (["train", *TINY], False),
    "tune": (["tune", "--budget", "1m", *TINY], False),
    "run": (["run"], True),
    "tune -- CMD": (["tune", "--budget", "1m"], True),
}


def new_run_argv(command: str, run_dir) -> list[str]:
    args, program = NEW_RUNS[command]
    return ["--no-ui", *args, "--run-dir", str(run_dir)] + (["--", sys.executable, "-c", "1"] if program else [])


@pytest.mark.parametrize("command", NEW_RUNS)
@pytest.mark.parametrize("used", ["finished run", "user folder"])
def test_every_command_refuses_a_used_directory_creating_nothing(tmp_path, capsys, command, used):
    """`gptop run --run-dir DIR` once wrote into a finished gptop train run and into a folder of the user's files:
    every command that starts a new run refuses both, exit 2, one line, nothing created or changed."""
    from gptop import cli as gcli

    target = old_run(tmp_path / "runs" / "a") if used == "finished run" else user_folder(tmp_path / "project")
    if used == "finished run":
        (target / ".gptop.lock").unlink()
    before = tree(tmp_path)
    assert gcli.main(new_run_argv(command, target)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gptop: error: --run-dir: "), err
    assert ("holds another run" if used == "finished run" else "holds files that are not a run's") in err[0]
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", NEW_RUNS)
def test_a_new_run_into_a_live_run_is_refused_naming_its_holder(tmp_path, capsys, command):
    """A live run's directory: the refusal names who holds it (pid, host), and never suggests removing it."""
    from gptop import cli as gcli

    run = old_run(tmp_path / "live")
    (run / ".gptop.lock").unlink()
    with RunLock.acquire(run, command="gptop train"):
        before = tree(tmp_path)
        assert gcli.main(new_run_argv(command, run)) == 2
        assert tree(tmp_path) == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is in use by pid {os.getpid()} on host {socket.gethostname()}" in err[0], err
    assert "(gptop train, since" in err[0] and "remove" not in err[0]


def test_resuming_a_run_keeps_its_rule(tmp_path, capsys):
    """--resume continues the run in its own directory (not a new run there): a finished run is resumable; a
    live one is refused naming its holder."""
    from gptop import preflight

    run = old_run(tmp_path / "a")
    (run / ".gptop.lock").unlink()
    request = preflight.LockRequest(run, command="gptop train", new_run=False, option="--resume")
    with preflight.claim_run_dir(request):
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()}") as e:
            RunLock.acquire(run, command="gptop train", option="--resume")
    assert e.value.option == "--resume" and "remove" not in e.value.message


def test_gptops_own_trainer_and_other_nodes_are_not_new_runs(tmp_path, monkeypatch):
    run = old_run(tmp_path / "run")
    with RunLock.acquire(run, command="gptop train") as lock:  # gptop resumed it (or restarts its own run)
        monkeypatch.setenv(LOCK_TOKEN_ENV, lock.token)
        monkeypatch.setenv(LOCK_NODE_ENV, "")
        assert not RunLock.for_trainer(run, new_run=True).held
    RunLock.acquire(run, command="gptop train", node="node1", new_run=True).release()  # nodes share the dir


@pytest.mark.parametrize("how", ["new", "fork"])
def test_gptop_and_the_trainer_refuse_a_reused_run_dir_before_writing_anything(tmp_path, how, capsys):
    """`cp -r runs/a runs/reuse; gptop --no-ui train --run-dir runs/reuse` (or `--resume runs/a --run-dir
    runs/reuse`, another run's weights into a third run's directory): exit 2, one line, nothing changed."""
    from gptop import cli as gcli
    from trainer import worker_cli as tcli

    a = old_run(tmp_path / "runs" / "a")
    reuse = old_run(tmp_path / "runs" / "reuse")
    before = tree(tmp_path / "runs")
    args = [*TINY, "--max-steps", "3", "--run-dir", str(reuse)] + (["--resume", str(a)] if how == "fork" else [])
    assert gcli.main(["--no-ui", "train", *args]) == 2
    assert tcli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("--run-dir" in line and "holds another run" in line for line in err), err
    assert all("--resume " + str(reuse) in line for line in err)
    assert tree(tmp_path / "runs") == before


def test_a_new_run_inside_another_runs_folders_is_refused_creating_nothing(tmp_path):
    run = old_run(tmp_path / "a")
    for where in (run / "checkpoints", run / "checkpoints" / "new", run / "profiles" / "x"):
        with pytest.raises(RunDirTaken, match="only that run writes") as e:
            RunLock.acquire(where, command="gptop train", new_run=True)
        assert e.value.option == "--run-dir"
    assert not (run / "checkpoints" / "new").exists() and not (run / "profiles").exists()
