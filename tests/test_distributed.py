"""Several ranks on this CPU machine: torchrun with the gloo backend, DDP and FSDP2.

The slow tests launch real 2-rank runs of the tiny model (one torch thread per
rank). The fast ones cover the pieces: torchrun's failure summary, the
launcher's argv, rank-specific faults, sharded checkpoint listing and pruning,
the comm timer.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from helpers import ROOT, TINY, TINY_TOKENS_PER_STEP, wait_for

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def gptop(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gptop", "--no-ui", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def events(run_dir: Path, rank: int = 0) -> list[dict]:
    name = "events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl"
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir) if e["type"] == "step"}


def leftovers(marker: str) -> list[psutil.Process]:
    """Processes (trainer ranks, torchrun) whose command line mentions `marker` (a unique run dir)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(marker in part for part in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            pass
    return out


def wait_gone(marker: str, timeout: float = 30) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = leftovers(marker)
        if not left:
            return []
        time.sleep(0.2)
    return leftovers(marker)


def done_steps(run_dir: Path | None, text: str | None = None) -> dict[int, int]:
    """Each rank's `done at step N` line in the trainer log (or in `text`)."""
    import re

    out = {}
    if text is None:
        text = (run_dir / "trainer.log").read_text()
    for m in re.finditer(r"\[trainer rank (\d+)\] done at step (\d+)", text):
        out[int(m.group(1))] = int(m.group(2))
    return out


# --------------------------------------------------------------------- fast
def test_torchrun_failure_summary_parsing():
    from gptop.supervisor import torchrun_failures

    text = """noise
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
trainer FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_05:36:57
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 19874)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_05:36:57
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 19875)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 19875
=======================================================
"""
    f = torchrun_failures(text)
    assert [(x["rank"], x["exitcode"], x["root"]) for x in f] == [(0, 1, False), (1, -9, True)]
    assert f[1]["traceback"].startswith("Signal 9")
    assert torchrun_failures("no summary here") == []


def test_launcher_argv():
    from gptop.supervisor import TorchrunLauncher

    one = TorchrunLauncher(2)(["--max-steps", "3"])
    assert one[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in one
    assert one[one.index("--nproc-per-node") + 1] == "2"
    assert one[-4:] == ["-m", "trainer", "--max-steps", "3"]
    multi = TorchrunLauncher(8, "2", 1, "node0:29500", None, "job7")([])
    assert "--standalone" not in multi
    for flag, value in (
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--rdzv-endpoint", "node0:29500"),
        ("--rdzv-backend", "c10d"),
        ("--rdzv-id", "job7"),
    ):
        assert multi[multi.index(flag) + 1] == value


def test_cli_nproc_builds_a_launcher():
    from gptop.cli import build_parser
    from gptop.preflight import launcher_of

    ns = build_parser().parse_args(["train", "--nproc", "2", "--parallel", "fsdp"])
    assert launcher_of(ns) is not None and getattr(ns, "run.parallel") == "fsdp"
    assert launcher_of(build_parser().parse_args(["train"])) is None


def test_faults_for_one_rank():
    from trainer.contract.config import ConfigError
    from trainer.faults import Faults

    assert Faults("kill@5:1", rank=1).at == {5: "kill"}
    assert Faults("kill@5:1", rank=0).at == {}
    assert Faults("nan@3,stop@7", rank=1).at == {3: "nan", 7: "stop"}  # no rank: every rank
    with pytest.raises(ConfigError):
        Faults("kill@5:x")
    with pytest.raises(ConfigError, match="one fault per step"):
        Faults("checkpoint@2,nan@2")
    assert Faults("kill@5:1,crash@5:0", rank=0).at == {5: "crash"}  # one per step on each rank


def test_sharded_checkpoints_are_listed_resolved_and_pruned(tmp_path):
    from trainer import checkpoint_files as ckpt
    from trainer.contract import rundir

    d = rundir.checkpoint_dir(tmp_path)
    for step in (2, 4, 6):
        p = rundir.dcp_path_for(tmp_path, step)
        p.mkdir(parents=True)
        (p / ".metadata").write_bytes(b"x")
        (p / ckpt.META).write_text(json.dumps({"format": ckpt.DCP_FORMAT, "step": step, "config": {}, "world_size": 2}))
    incomplete = rundir.dcp_path_for(tmp_path, 8)  # renamed without gptop.json: cannot happen, but is skipped
    incomplete.mkdir()
    (d / "step-00000010.dcp.tmp").mkdir()  # a save that was killed
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [2, 4, 6, 8]
    seen = []
    path, meta = ckpt.resolve_resume(tmp_path, on_corrupt=seen.append)
    assert path.name == "step-00000006.dcp" and meta["step"] == 6 and meta["path"] == str(path)
    assert seen and "step-00000008.dcp" in seen[0]
    assert ckpt.resolve_resume(rundir.dcp_path_for(tmp_path, 4))[1]["step"] == 4
    deleted = rundir.prune(tmp_path, keep=2)
    assert sorted(p.name for p in d.iterdir()) == ["step-00000006.dcp", "step-00000008.dcp"]
    assert any(p.name.endswith(".dcp.tmp") for p in deleted)


def test_comm_timer_counts_overlapping_spans_once():
    from trainer.dist import CommTimer

    c = CommTimer(2)
    c._spans = [(1.0, 1.5), (1.2, 1.6), (2.0, 2.1)]
    assert c.take_ms() == pytest.approx(700.0)
    assert c.take_ms() is None


# --------------------------------------------------------------------- slow
# One uninterrupted 2-rank run per configuration, checkpointed on request after step AT, and that checkpoint
# resumed in a run directory of its own: the run is the reference the resumed one must match loss for loss (a
# checkpoint that changed the run or a resume that lost state would differ). The runs of every configuration
# start side by side (their start-up, importing torch, dominates) and serve the tests below. DDP is the LoRA run's:
# its checkpoint holds less than a full model's, but the same DDP path writes and resumes it (FSDP's holds the full
# model).
AT, LAST = 4, 8
RESUMED = {
    "fsdp": [*TINY, "--max-steps", str(LAST), "--log-every", "2", "--parallel", "fsdp"],
    "lora": [
        *TINY,
        "--max-steps",
        str(LAST),
        "--log-every",
        "2",
        "--parallel",
        "ddp",
        "--lora",
        "8",
        "--lora-dropout",
        "0.1",
    ],
}
PARALLEL = {"ddp": "lora", "fsdp": "fsdp"}  # the run of each parallel mode


@dataclass
class Resumed:
    full: Path  # the uninterrupted run, with the requested checkpoint after step AT (and its final one)
    resumed: Path  # that checkpoint resumed by `gptop train --nproc 2 --resume`
    done: dict[str, subprocess.CompletedProcess] = field(default_factory=dict)  # each stage's process

    @property
    def checkpoint(self) -> Path:
        return self.full / "checkpoints" / f"step-{AT:08d}.dcp"

    def ok(self, *stages: str) -> None:
        for stage in stages:
            r = self.done.get(stage)
            assert r is not None, f"{stage}: not run (an earlier stage failed: {sorted(self.done)})"
            assert r.returncode == 0, f"{stage}: {r.stderr[-3000:]}"


def run_side_by_side(cmds: dict[tuple[str, str], list[str]], timeout: float = 400) -> dict:
    """Commands started together (their start-up, importing torch, dominates): each one's CompletedProcess."""
    procs = {
        k: subprocess.Popen(c, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k, c in cmds.items()
    }
    done = {}
    try:
        for k, p in procs.items():
            out, err = p.communicate(timeout=timeout)
            done[k] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():  # a timeout leaves no run behind
            if p.poll() is None:
                p.kill()
                p.communicate()
    return done


def copy_checkpoint(ck: Path, run_dir: Path) -> Path:
    """A run directory holding only `ck` and its run's config.toml: a resume of it starts at that checkpoint."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(ck, run_dir / "checkpoints" / ck.name)
    shutil.copy(ck.parent.parent / "config.toml", run_dir / "config.toml")
    return run_dir


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, Resumed]:
    base = tmp_path_factory.mktemp("resumed")
    out = {name: Resumed(base / name / "full", base / name / "resumed") for name in RESUMED}
    gptop_train = [sys.executable, "-m", "gptop", "--no-ui", "train", "--nproc", "2"]
    first = {
        (name, "full"): [*gptop_train, *args, "--run-dir", str(out[name].full), "--fault", f"checkpoint@{AT}"]
        for name, args in RESUMED.items()
    }
    for (name, stage), r in run_side_by_side(first).items():
        out[name].done[stage] = r
    second = {
        (name, "resumed"): [*gptop_train, "--resume", str(copy_checkpoint(r.checkpoint, r.resumed))]
        for name, r in out.items()
        if r.done["full"].returncode == 0
    }
    if out["fsdp"].done["full"].returncode == 0:  # another world size: one process resumes it (DCP reshards)
        one = copy_checkpoint(out["fsdp"].checkpoint, base / "fsdp" / "one")
        second["fsdp", "one process"] = [sys.executable, "-m", "trainer", "--resume", str(one)]
    if out["lora"].done["full"].returncode == 0:
        second["lora", "export"] = [
            sys.executable,
            "-m",
            "gptop",
            "export",
            str(out["lora"].full),
            str(base / "adapter"),
        ]
    for (name, stage), r in run_side_by_side(second).items():
        out[name].done[stage] = r
    return out


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_checkpoint_and_resume_exactly(resumed, parallel):
    """`gptop train --nproc 2`: both ranks emit steps, a requested checkpoint holds both ranks' shards, and its
    resume matches the uninterrupted 2-rank run loss for loss."""
    run = resumed[PARALLEL[parallel]]
    run.ok("full")
    names = {p.name for p in run.checkpoint.iterdir()}
    assert {".metadata", "gptop.json", "rank0.pt", "rank1.pt"} <= names
    assert sum(n.endswith(".distcp") for n in names) == 2  # each rank wrote its shards
    assert not list((run.full / "checkpoints").glob("*.tmp"))
    run.ok("resumed")

    a, b = losses(run.full), losses(run.resumed)
    assert sorted(a) == list(range(2, LAST + 1, 2))
    assert sorted(b) == list(range(AT + 2, LAST + 1, 2)) and b == {s: a[s] for s in b}  # exact, not close

    hello = [e for e in events(run.full) if e["type"] == "hello" and not e.get("early")]
    assert len(hello) == 1 and hello[0]["world_size"] == 2 and hello[0]["parallel"] == parallel
    for rank in (0, 1):
        steps = [e for e in events(run.full, rank) if e["type"] == "step"]
        assert [e["step"] for e in steps] == list(range(2, LAST + 1, 2)) and all(e["rank"] == rank for e in steps)
        for e in steps:
            assert e["tokens"] == e["step"] * TINY_TOKENS_PER_STEP  # global tokens: both ranks' batches
            assert abs(sum(e["phases_ms"].values()) - e["step_ms"]) < 1e-3 * e["step_ms"] + 1e-6
            if parallel == "ddp":
                assert 0 <= e["comm_ms"] <= e["phases_ms"]["backward"] + 1.0
            else:
                assert "comm_ms" not in e
    r0 = [e for e in events(run.full, 0) if e["type"] == "step"]
    r1 = [e for e in events(run.full, 1) if e["type"] == "step"]
    assert [e["loss"] for e in r0] == [e["loss"] for e in r1]  # the global loss, the same on all ranks

    if parallel == "fsdp":
        # Another world size: the 2-rank sharded checkpoint resumed in one process (DCP reshards).
        run.ok("one process")
        c = losses(run.resumed.parent / "one")
        assert c[AT + 2] == pytest.approx(a[AT + 2], rel=1e-4) and c[LAST] == pytest.approx(a[LAST], rel=1e-3)


@pytest.mark.process
@pytest.mark.slow
def test_lora_on_two_ranks_checkpoints_only_the_adapters_and_resumes_exactly(resumed):
    """DDP with --lora: the sharded checkpoint holds the adapters and their optimizer state (the frozen base
    is rebuilt from its source), its resume matches the uninterrupted run loss for loss, and the run exports."""
    from torch.distributed.checkpoint import FileSystemReader

    run = resumed["lora"]
    run.ok("full")
    keys = [
        k for k in FileSystemReader(str(run.checkpoint)).read_metadata().state_dict_metadata if k.startswith("model.")
    ]
    assert keys and all(".lora_" in k for k in keys), [k for k in keys if ".lora_" not in k][:5]
    run.ok("resumed")
    a, b = losses(run.full), losses(run.resumed)
    assert sorted(a) == list(range(2, LAST + 1, 2))
    assert sorted(b) == list(range(AT + 2, LAST + 1, 2)) and b == {s: a[s] for s in b}
    run.ok("export")
    assert (run.full.parent.parent / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.process
@pytest.mark.slow
def test_a_dead_rank_stops_the_run_and_is_named(tmp_path):
    run = tmp_path / "killed"
    r = gptop("train", "--nproc", "2", *TINY, "--max-steps", "200", "--run-dir", str(run), "--fault", "kill@5:1")
    assert r.returncode == 1, r.stdout[-2000:]
    assert "rank 1 died (killed by signal 9 (SIGKILL))" in r.stderr, r.stderr[-2000:]
    assert "rank 0 stopped after losing contact" in r.stderr
    err = [e for e in events(run) if e["type"] == "error"]
    assert err and err[0]["rank"] == 0 and err[0]["lost_peer"] is True
    assert wait_gone(str(run), timeout=10) == []


@pytest.mark.process
@pytest.mark.slow
def test_commands_take_effect_on_the_same_step_on_every_rank(tmp_path):
    """A checkpoint request and a graceful stop through the session reach both ranks and are agreed."""
    from gptop.session import Session, SessionOptions
    from gptop.supervisor import TorchrunLauncher
    from trainer.worker_cli import parse_config
    from trainer.contract.events import CheckpointEvent, StepEvent

    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    run = tmp_path / "cmds"
    cfg = parse_config([*TINY, "--max-steps", "100000", "--run-dir", str(run)])

    class Sampler:  # no device telemetry needed here
        def subscribe(self, fn):
            pass

        def start(self):
            pass

        def stop(self):
            pass

    s = Session(cfg, SessionOptions(launcher=TorchrunLauncher(2)), sampler=Sampler())
    seen = threading.Event()
    ckpts: list[CheckpointEvent] = []

    class Watch:  # a view: sees every event the session sees
        def on_event(self, e):
            if isinstance(e, StepEvent) and e.step >= 3:
                seen.set()
            if isinstance(e, CheckpointEvent):
                ckpts.append(e)

        def on_log(self, line, stream):
            pass

        def on_status(self, status, message):
            pass

    s.add_view(Watch())
    try:
        s.start()
        assert seen.wait(90), s.state.logs
        s.checkpoint()
        wait_for(lambda: ckpts, 30, "the requested checkpoint")
        assert ckpts[0].reason == "requested"
        s.stop(interrupted=False)
        assert s.wait(60) == 0, s.state.status_message
    finally:
        s.close()
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    import torch

    requested = Path(ckpts[0].path)
    for rank in (0, 1):  # both ranks wrote their part of the requested checkpoint at the same step
        assert torch.load(requested / f"rank{rank}.pt", weights_only=True)["step"] == ckpts[0].step
    done = done_steps(run)
    assert len(done) == 2 and done[0] == done[1]
    assert [e.reason for e in ckpts] == ["requested", "stop"] and ckpts[1].step == done[0]
    assert wait_gone(str(run), timeout=10) == []


@pytest.mark.process
@pytest.mark.slow
def test_sigterm_from_torchrun_by_hand_is_one_agreed_stop(tmp_path):
    """`python -m torch.distributed.run ... -m trainer`: SIGTERM to torchrun reaches every rank, which stop
    on one step with a checkpoint."""
    run = tmp_path / "byhand"
    p = subprocess.Popen(
        [*TORCHRUN, "-m", "trainer", *TINY, "--max-steps", "100000", "--run-dir", str(run)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if (run / "events.rank1.jsonl").exists() and any(e["type"] == "step" for e in events(run, 1)):
                break
            time.sleep(0.2)
        else:
            pytest.fail("no step from rank 1")
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    done = done_steps(None, out)
    assert len(done) == 2 and done[0] == done[1], out[-3000:]
    stop = [e for e in events(run) if e["type"] == "done"]
    # torchrun forwards SIGTERM to every rank; whichever rank's handler ran first, the stop is agreed on one step
    assert stop and stop[0]["reason"] in ("SIGTERM", "stop signal (another rank)") and stop[0]["step"] == done[0]
    assert (run / "checkpoints" / f"step-{done[0]:08d}.dcp" / "gptop.json").is_file()
    assert wait_gone(str(run), timeout=10) == []


@pytest.mark.process
@pytest.mark.slow
def test_gptop_killed_hard_leaves_no_rank_behind(tmp_path):
    """kill -9 of gptop: the ranks see their socket close, agree to stop, checkpoint and exit; torchrun too."""
    run = tmp_path / "orphans"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gptop",
            "--no-ui",
            "train",
            "--nproc",
            "2",
            *TINY,
            "--max-steps",
            "100000",
            "--run-dir",
            str(run),
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if (run / "events.rank1.jsonl").exists() and any(e["type"] == "step" for e in events(run, 1)):
            break
        time.sleep(0.2)
    else:
        p.kill()
        pytest.fail("no step from rank 1")
    p.kill()
    p.wait()
    assert wait_gone(str(run), timeout=60) == []
    done = done_steps(run)
    assert len(done) == 2 and done[0] == done[1]
    assert (run / "checkpoints" / f"step-{done[0]:08d}.dcp" / "gptop.json").is_file()


def dcp_tensors(path: Path, scratch: Path) -> list:
    """Every floating tensor of a sharded checkpoint, read whole in this process (DCP's format utils)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    found, todo = [], [torch.load(out, weights_only=False)]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo += list(x.values())
        elif isinstance(x, (list, tuple)):
            todo += list(x)
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            found.append(x)
    return found


@pytest.mark.process
@pytest.mark.slow
def test_two_ranks_never_checkpoint_a_non_finite_state(tmp_path):
    """Issue 10 with 2 ranks. The --lr 1e4 command (FSDP2: the skipped update on sharded parameters) ends
    with every DCP checkpoint finite, recovered or stopped with the nan error. Weights poisoned on rank 1
    only after a finite step (DDP) are caught by both ranks before the checkpoint, which is not written,
    and both roll back to the newest sharded checkpoint that verifies."""
    import torch

    lr_run, w_run = tmp_path / "lr", tmp_path / "weights"
    jobs = [
        (
            lr_run,
            [
                "--max-steps",
                "30",
                "--lr",
                "1e4",
                "--warmup-steps",
                "0",
                "--checkpoint-every",
                "1",
                "--parallel",
                "fsdp",
            ],
        ),
        (w_run, ["--max-steps", "8", "--checkpoint-every", "2", "--fault", "nan-weights@3:1"]),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gptop", "--no-ui", "train", "--nproc", "2", *TINY, "--run-dir", str(d), *extra],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d, extra in jobs
    ]
    codes = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        codes.append((p.returncode, err))
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    code, err = codes[0]
    errors = [e for e in events(lr_run) if e["type"] == "error"]
    assert code == 0 or (code == 1 and [e["kind"] for e in errors] == ["nan"]), err[-3000:]
    ckpts = sorted((lr_run / "checkpoints").glob("*.dcp"))
    assert ckpts
    for ck in ckpts:
        assert all(torch.isfinite(t).all() for t in dcp_tensors(ck, scratch)), ck

    code, err = codes[1]
    assert code == 0, err[-3000:]
    ev = events(w_run)
    assert any("non-finite weights or optimizer state" in e["message"] for e in ev if e["type"] == "warning")
    (rb,) = [e for e in ev if e["type"] == "warning" and e.get("kind") == "nan_rollback"]
    assert rb["step"] == 2 and "step-00000002.dcp" in rb["message"]
    assert [e["step"] for e in ev if e["type"] == "checkpoint"] == [2, 4, 6, 8]  # 4 only after the rollback
    done = done_steps(w_run)
    assert done == {0: 8, 1: 8}
    for ck in sorted((w_run / "checkpoints").glob("*.dcp")):
        assert all(torch.isfinite(t).all() for t in dcp_tensors(ck, scratch)), ck


@pytest.mark.slow
@pytest.mark.process
def test_two_nodes_on_one_host_each_know_the_run(tmp_path):
    """Two gptop processes, one rank each, over a c10d rendezvous (docs/distributed.md, "Several nodes"):
    the second node's gptop gets a hello too (its header reads step N/MAX, not N/?), and its hint only
    suggests bf16 where its device runs bf16 natively."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "gptop",
        "--no-ui",
        "train",
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        "issue13",
        *TINY,
        "--max-steps",
        "6",
        "--log-every",
        "3",
        "--checkpoint-every",
        "0",
        "--run-dir",
        str(run),
    ]
    # --node-rank names each node's lock on the shared run directory (gptop.preflight: node_key); c10d still
    # assigns the ranks
    procs = [
        subprocess.Popen(
            [*args, "--node-rank", str(i)],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    hellos = {r: [e for e in events(run, r) if e["type"] == "hello" and not e.get("early")] for r in (0, 1)}
    assert all(len(h) == 1 for h in hellos.values()), hellos  # one per node, from its first rank
    for out in outs:
        assert "step 6/6 " in out and "/?" not in out, out
        for line in out.splitlines():
            if line.startswith("hint:") and "--precision bf16" in line:
                assert all(h[0]["device"]["cpu_bf16"] for h in hellos.values()), line


def test_fsdp2_is_found_on_every_torch_the_project_allows(monkeypatch):
    """pyproject.toml allows torch 2.5, where FSDP2 lives in torch.distributed._composable.fsdp (public in
    torch.distributed.fsdp only from 2.6): `--parallel fsdp` finds it in either place."""
    import types

    import torch.distributed.fsdp as public

    from trainer import dist as D

    fully_shard, policy = D.fsdp2()
    assert fully_shard is public.fully_shard and policy is public.MixedPrecisionPolicy
    old = types.ModuleType("torch.distributed.fsdp")  # torch 2.5: FSDP1's names only
    composable = types.ModuleType("torch.distributed._composable.fsdp")
    composable.fully_shard, composable.MixedPrecisionPolicy = (lambda m, **kw: m), type("Policy", (), {})
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", old)
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.fsdp", composable)
    assert D.fsdp2() == (composable.fully_shard, composable.MixedPrecisionPolicy)
    assert D.fsdp_precision("fp32") == (None, None)


@pytest.fixture
def one_rank(tmp_path):
    """Makes a real process group of one rank in this process (gloo over a file store), destroyed after."""
    import torch.distributed as dist

    real_init = dist.init_process_group  # before a test replaces it

    def init(timeout_s: float) -> None:
        real_init(
            backend="gloo",
            init_method=f"file://{tmp_path / 'store'}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_clients_gloo_control_group_times_out_with_the_programs_group(one_rank, monkeypatch):
    """Every per-step agreement, DCP's save barrier and the --micro-batch auto probe's host_max run on the gloo
    control group beside NCCL: made without a timeout, torch gave it gloo's default of 30 minutes, so one stalled
    rank held all the others that long. A client's control group takes the timeout of the program's own group."""
    import torch.distributed as dist

    from trainer import dist as D

    one_rank(77.0)
    assert D.group_timeout() == datetime.timedelta(seconds=77)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # the program's group is NCCL (a GPU run)
    ctrl = D.control_group()
    assert ctrl is not None and D.group_timeout(ctrl) == datetime.timedelta(seconds=77)
    assert D.host_max([3, 1], ctrl) == [3, 1]


def test_the_trainers_gloo_control_group_times_out_with_the_run(one_rank, monkeypatch):
    """The trainer's group (NCCL on a GPU; here the same call over gloo) and its control group take one timeout."""
    import torch
    import torch.distributed as dist

    from trainer import dist as D

    asked: list[dict] = []

    def init_here(**kw):  # no NCCL on this machine: the trainer's call, made over gloo
        asked.append(kw)
        one_rank(kw["timeout"].total_seconds())

    monkeypatch.setattr(dist, "init_process_group", init_here)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    group = D.Group(0, 1, 0, torch.device("cuda:0"))
    group.init(timeout_s=123.0)
    assert asked[0]["backend"] == "nccl" and asked[0]["timeout"] == datetime.timedelta(seconds=123)
    assert group.ctrl is not None and D.group_timeout(group.ctrl) == datetime.timedelta(seconds=123)
    assert group.agree([5]) == [5]
    # the --micro-batch auto probe's count of the training group's collectives (the control group's are not in it)
    before = group.collectives()
    assert before is not None
    group.sum_(torch.ones(2))
    assert group.host_maxes([1.0, -2.0]) == [1.0, -2.0]
    assert group.collectives() == before + 1


def _probe_rank(rank: int, store: str, out: str) -> None:
    """One of two gloo ranks probing micro-batches whose forward and backward issue three collectives; above 2,
    both run out of memory after the second (in step); rank 1's peaks are twice rank 0's."""
    import torch
    import torch.distributed as dist

    from trainer import dist as D
    from trainer.autobatch import probe_micro_batch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = D.Group(rank, 2, rank, torch.device("cpu"))
    group.init()
    counts, tried = [], []

    def probe_local(mb: int) -> int:
        tried.append(mb)
        for i in range(3):
            if mb > 2 and i == 2:
                counts.append(group.collectives())
                raise torch.OutOfMemoryError(f"micro-batch {mb}")
            group.sum_(torch.ones(4))
        counts.append(group.collectives())
        return 1000 * mb * (1 + rank)

    got = probe_micro_batch(probe_local, 64, capacity=10_000, group=group, compile_mode="off", log=lambda s: None)
    Path(out).write_text(json.dumps({"mb": got, "counts": counts, "tried": tried}))
    group.destroy()


@pytest.mark.process
@pytest.mark.slow
def test_two_gloo_ranks_probe_in_step_and_agree(tmp_path):
    """The probe's agreement over a real group of two processes: torch counts each rank's collectives alike, both
    ranks run out of memory at the same collective (in step, so the search goes on), they probe the same sizes
    (rank 1's peaks decide: 4 is predicted to fit it, 8 not) and choose the same one."""
    import torch.multiprocessing as mp

    outs = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_probe_rank, args=(r, str(tmp_path / "store"), str(outs[r]))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [json.loads(o.read_text()) for o in outs]
    assert got[0] == got[1], got
    assert got[0]["mb"] == 2 and got[0]["tried"] == [1, 2, 4]
