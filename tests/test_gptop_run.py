"""End to end: `gptop run -- CMD` supervising real commands on the CPU (the examples, a transformers.Trainer
script the examples did not write, plain commands without a client)."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from helpers import ROOT, gone, gptop_env, run_events, start_gptop, wait_for
from trainer.contract.events import parse, read_events

pytestmark = [pytest.mark.slow, pytest.mark.process]

EXAMPLES = ROOT / "examples"
HF_SCRIPT = ROOT / "tests" / "fixtures" / "hf_script.py"


def client_hello(run_dir: Path):
    return next((e for e in run_events(run_dir, "hello") if e.client is not None), None)


def test_a_transformers_script_as_json_lines_and_the_same_script_without_gptop(tmp_path):
    p = start_gptop(
        "--no-ui",
        "--json",
        "run",
        "--run-dir",
        "run",
        "--",
        sys.executable,
        str(HF_SCRIPT),
        "--out",
        "hf",
        cwd=tmp_path,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    evs = [parse(line) for line in out.splitlines()]  # every stdout line is an event of the one schema
    kinds = {e.type for e in evs}
    assert {"hello", "step", "device", "status", "done", "checkpoint"} <= kinds
    hello = next(e for e in evs if e.type == "hello" and e.client == "transformers")
    assert hello.max_steps == 12 and hello.model.family == "GPTNeoXForCausalLM"
    steps = [e for e in evs if e.type == "step"]
    assert [e.step for e in steps] == [3, 6, 9, 12]  # the script's logging_steps
    assert all(e.loss is not None and e.phases_ms["forward"] > 0 and e.phases_ms["backward"] > 0 for e in steps)
    assert steps[-1].tokens == 12 * 4 * 2 * 20
    assert any(e.type == "device" and e.cpu is not None and e.cpu.proc_rss for e in evs)  # its process tree
    assert [e.step for e in evs if e.type == "checkpoint"] == [6, 12] and (tmp_path / "hf" / "checkpoint-12").is_dir()
    assert "gptop: run finished: 12 steps" in err and "command" in err  # the summary, on stderr with --json
    with_gptop = json.loads((tmp_path / "run" / "trainer.log").read_text().strip().splitlines()[-1])

    plain = subprocess.run(
        [sys.executable, str(HF_SCRIPT), "--out", "hf2"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout.strip().splitlines()[-1]) == with_gptop  # trains as before, bit for bit

    r = subprocess.run(
        [sys.executable, "-m", "gptop", "report", "run"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "12/12 steps" in r.stdout and f"command   {sys.executable} {HF_SCRIPT}" in r.stdout
    assert "phases    data" in r.stdout and "2 written, 2 kept" in r.stdout
    export = start_gptop("export", "run", "exported", cwd=tmp_path)  # a Trainer's checkpoints: from_pretrained
    _, err = export.communicate(timeout=120)
    assert export.returncode == 2 and "from_pretrained: the newest, " in err and "checkpoint-12" in err, err

    # best.toml of a tune of this script says how to apply it: its GPTOP_TOGGLES line, given to gptop run as it
    # says, reaches the script's tuned_args (micro-batch 2: the Trainer's own batch of 8 kept with 4 steps)
    from tuner.tuning_report import TunedCommand, best_toml

    best = dataclasses.replace(hello.toggles, micro_batch=2)
    argv = [sys.executable, str(HF_SCRIPT), "--out", "hf3"]
    text = best_toml(best, TunedCommand(argv, hello.toggles, hello.micro_batch * hello.accumulation))
    assert "per_device_train_batch_size=2, gradient_accumulation_steps=4" in text
    assignment, *command = shlex.split(next(x for x in text.splitlines() if "GPTOP_TOGGLES=" in x)[1:])
    name, _, value = assignment.partition("=")
    assert command == ["gptop", "run", "--", *argv]
    tuned = subprocess.run(
        [sys.executable, "-m", "gptop", "--no-ui", "run", "--run-dir", "run3", *command[2:]],
        cwd=tmp_path,
        env={**gptop_env(), name: value},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tuned.returncode == 0, tuned.stderr
    applied = client_hello(tmp_path / "run3")
    assert (applied.micro_batch, applied.accumulation, applied.toggles) == (2, 4, best)


def test_ctrl_c_stops_a_plain_loop_with_its_own_checkpoint(tmp_path):
    run = tmp_path / "run"
    p = start_gptop(
        "--no-ui",
        "run",
        "--run-dir",
        "run",
        "--log-every",
        "2",
        "--",
        sys.executable,
        str(EXAMPLES / "train_loop.py"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.02",
        "--out",
        "ckpt",
        cwd=tmp_path,
    )
    wait_for(lambda: run_events(run, "step"), timeout=300, what="the first step event")
    pid = client_hello(run).pid
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert gone(pid)
    done = run_events(run, "done")[-1]
    ckpt = run_events(run, "checkpoint")[-1]
    # the stop gptop asked for (its reason wins over the signal that also reached the program's main process)
    assert done.reason in ("stop requested", "SIGINT") and ckpt.reason == "stop" and ckpt.step == done.step
    assert Path(ckpt.path) == tmp_path / "ckpt" / f"step-{done.step}.pt" and Path(ckpt.path).exists()
    assert "gptop: run stopped by you at step" in out and f"checkpoint {ckpt.path}" in out
    r = subprocess.run(
        [sys.executable, "-m", "gptop", "--json", "report", "run"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(r.stdout.splitlines()) == 1, r.stdout  # --json: one JSON line, as everywhere
    s = json.loads(r.stdout)
    assert s["steps"] >= 2 and s["checkpoints_kept"] == [{"step": ckpt.step, "path": ckpt.path}]
    assert s["done"] == done.reason and s["command"][1] == str(EXAMPLES / "train_loop.py")


# nanoGPT's train.py loop as it is (micro-steps under autocast, the next batch fetched between a forward and its
# backward, a GradScaler, clipping, an evaluation under no_grad and a save of ckpt.pt at the top of an
# iteration), with a tiny model, random data and known waits; the probe's lines end in `# gptop`.
NANOGPT = """
import os, sys, time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from gptop.integrations.torch import Probe  # gptop

batch_size, block_size, vocab_size, gradient_accumulation_steps = 4, 16, 32, 3
max_iters, eval_interval, eval_iters, grad_clip = 12, 4, 4, 1.0
DATA_S, EVAL_S, SAVE_S = (float(a) for a in sys.argv[1:4])
out_dir = "out"
torch.manual_seed(0)
data = torch.randint(vocab_size, (4096,))
ctx = nullcontext()  # nanoGPT's on a CPU; torch.amp.autocast on a GPU
scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT's: enabled for float16 only


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab_size, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        self.lm_head = torch.nn.Linear(32, vocab_size)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        logits = self.lm_head(x + self.mlp(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def get_batch(split):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = []
    for _ in range(eval_iters):
        X, Y = get_batch("val")
        time.sleep(EVAL_S / eval_iters)
        losses.append(model(X, Y)[1])
    model.train()
    return torch.stack(losses).mean().item()


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
probe = Probe(model, optimizer=optimizer, max_steps=max_iters)  # gptop
os.makedirs(out_dir, exist_ok=True)
X, Y = get_batch("train")
for iter_num in range(max_iters):
    probe.step(iter_num + 1)  # gptop
    if iter_num % eval_interval == 0 and iter_num > 0:
        val_loss = estimate_loss()
        time.sleep(SAVE_S)
        torch.save({"model": model.state_dict(), "iter_num": iter_num}, os.path.join(out_dir, "ckpt.pt"))
        probe.checkpointed(os.path.join(out_dir, "ckpt.pt"))  # gptop
    time.sleep(DATA_S)  # a slow input pipeline, before the step's first forward
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    probe.log(loss=loss * gradient_accumulation_steps)  # gptop
probe.close()  # gptop
"""


def test_a_nanogpt_loop_with_one_probe_step_call_gets_the_breakdown(tmp_path):
    """The probe's hooks in a real process under gptop run: every step's phases, its tokens from the batch's
    shape, the evaluation and the save no part of a step, a checkpoint's time the save's, ckpt.pt kept once."""
    data_s, eval_s, save_s = 0.03, 1.0, 0.2
    (tmp_path / "train.py").write_text(NANOGPT)
    p = start_gptop(
        "--no-ui",
        "--json",
        "run",
        "--run-dir",
        "run",
        "--log-every",
        "1",
        "--",
        sys.executable,
        "train.py",
        str(data_s),
        str(eval_s),
        str(save_s),
        cwd=tmp_path,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    evs = [parse(line) for line in out.splitlines()]
    hello = next(e for e in evs if e.type == "hello" and e.client == "probe")
    assert hello.model.family == "GPT" and hello.max_steps == 12
    steps = [e for e in evs if e.type == "step"]
    assert [e.step for e in steps] == list(range(1, 13))
    for e in steps:
        ph = e.phases_ms
        assert all(ph[k] > 0 for k in ("forward", "backward", "optimizer")), (e.step, ph)
        assert math.isclose(sum(ph.values()), e.step_ms, rel_tol=1e-6), (e.step, ph, e.step_ms)
        # the data wait is the sleep before the first forward; the evaluation and the save are in no step
        assert data_s * 1e3 * 0.95 <= ph["data"] < (data_s + eval_s / 2) * 1e3, (e.step, ph)
        assert e.step_ms < (data_s + eval_s / 2) * 1e3, (e.step, e.step_ms)
        assert e.tokens == e.step * 4 * 16 * 3  # batch x block x micro-steps, from the forwards' input
    ckpts = [e for e in evs if e.type == "checkpoint"]
    assert [c.step for c in ckpts] == [4, 8] and {c.path for c in ckpts} == {str(tmp_path / "out" / "ckpt.pt")}
    assert all(save_s <= c.seconds < save_s + eval_s / 2 for c in ckpts), [c.seconds for c in ckpts]
    r = subprocess.run(
        [sys.executable, "-m", "gptop", "--json", "report", "run"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    s = json.loads(r.stdout)
    assert s["checkpoints_written"] == 2 and s["checkpoints_kept"] == [{"step": 8, "path": ckpts[0].path}]


def test_kill_9_of_gptop_leaves_nothing_running(tmp_path):
    # a loop with the probe: it sees its channel close, checkpoints and exits
    run = tmp_path / "run"
    p = start_gptop(
        "--no-ui",
        "run",
        "--run-dir",
        "run",
        "--",
        sys.executable,
        str(EXAMPLES / "train_loop.py"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.02",
        "--out",
        "ckpt",
        cwd=tmp_path,
    )
    wait_for(lambda: client_hello(run) and run_events(run, "step"), timeout=300, what="a step")
    pid = client_hello(run).pid
    # a command without a client: the warden ends it
    run2 = tmp_path / "run2"
    p2 = start_gptop(
        "--no-ui", "run", "--run-dir", "run2", "--", sys.executable, "-c", "import time; time.sleep(600)", cwd=tmp_path
    )
    wait_for(lambda: run_events(run2, "hello"), timeout=120, what="the command's start")
    pid2 = run_events(run2, "hello")[0].pid
    for gp in (p, p2):
        gp.kill()
        gp.wait()
    assert gone(pid, timeout=120), "the loop outlived gptop"
    assert gone(pid2, timeout=120), "the plain command outlived gptop"
    done = run_events(run, "done")[-1]
    # The loop's client sees both ends of gptop: its channel's end of file and the warden's SIGTERM, whichever
    # comes first (on a loaded machine the warden's can); either is the graceful stop, with its checkpoint.
    assert done.reason in ("launcher went away", "SIGTERM"), done.reason
    assert run_events(run, "checkpoint")[-1].step == done.step
    wardens = [
        q
        for q in psutil.process_iter(["cmdline"])  # [python, -m, gptop.warden, FD, PID, GRACE]
        if (q.info["cmdline"] or [])[2:3] == ["gptop.warden"] and q.info["cmdline"][4] in (str(pid), str(pid2))
    ]
    assert all(gone(q.pid, timeout=60) for q in wardens)


def test_exit_codes_of_plain_commands(tmp_path):
    # exits 0: finished; fails: exit 1 with its stderr in the summary
    p = start_gptop("--no-ui", "run", "--run-dir", "ok", "--", sys.executable, "-c", "print('hi')", cwd=tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "gptop: run finished after" in out, out + err
    fail = "import sys; print('something broke', file=sys.stderr); sys.exit(3)"
    p = start_gptop("--no-ui", "run", "--run-dir", "bad", "--", sys.executable, "-c", fail, cwd=tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, out + err
    assert "failed (exit code 3)" in err and "    something broke" in out  # the summary's stderr lines
    # stopped, but it ignores SIGINT: killed after --grace, exit 130, nothing left
    ignore = (
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    )
    p = start_gptop(
        "--no-ui", "run", "--run-dir", "stuck", "--grace", "1", "--", sys.executable, "-c", ignore, cwd=tmp_path
    )
    # its output and gptop's record of the start (the hello, with its pid) are written by two threads
    wait_for(
        lambda: (
            "up" in (tmp_path / "stuck" / "trainer.log").read_text()
            if (tmp_path / "stuck" / "trainer.log").exists()
            else False
        ),
        timeout=120,
        what="the command to start",
    )
    wait_for(lambda: run_events(tmp_path / "stuck", "hello"), timeout=60, what="gptop's record of the start")
    pid = run_events(tmp_path / "stuck", "hello")[0].pid
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and gone(pid, timeout=30)
    assert "the command ended (signal 9)" in out


def test_restarts_and_crashes_leave_no_channel_directory_behind(tmp_path):
    """Each start of the command gets a channel (a socket in a directory of its own under TMPDIR); the directory
    goes when that process ends, whether it failed (each restart), was killed or finished."""
    from helpers import gptop_env, private_tmpdir

    crash = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with private_tmpdir() as tmp:
        for name, code, restarts, argv in (
            ("fails", 1, 2, ["--restart-on-failure", "2", "--", sys.executable, "-c", "import sys; sys.exit(3)"]),
            ("crashes", 1, 1, ["--restart-on-failure", "1", "--", sys.executable, "-c", crash]),
            ("ends", 0, 0, ["--", sys.executable, "-c", "print('hi')"]),
        ):
            r = subprocess.run(
                [sys.executable, "-m", "gptop", "--no-ui", "run", "--run-dir", name, *argv],
                cwd=tmp_path,
                env=gptop_env(TMPDIR=str(tmp)),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert r.returncode == code and r.stdout.count("status: restarting") == restarts, r.stdout + r.stderr
            assert list(tmp.iterdir()) == [], name


def test_tokens_continue_over_a_restart_of_a_loop_whose_count_starts_at_0(tmp_path):
    """`--restart-on-failure`: the loop fails once after step 10 and resumes from its checkpoint at step 8, its
    probe counting from 0 again (tests/fixtures/restarting_loop.py: 16 steps of 96 tokens). The report counts
    the 16 kept steps' tokens, and the 18 steps trained (9 and 10 twice) as processed."""
    script = ROOT / "tests" / "fixtures" / "restarting_loop.py"
    args = ("run", "--run-dir", "run", "--log-every", "1", "--restart-on-failure", "1", "--")
    p = start_gptop("--no-ui", *args, sys.executable, str(script), "ckpt", cwd=tmp_path)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, out + err
    assert "16/16 steps, 1.5k tokens kept, 1.7k processed incl. 2 rolled-back steps" in out, out
    r = subprocess.run(
        [sys.executable, "-m", "gptop", "--json", "report", "run"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    s = json.loads(r.stdout)
    assert (s["starts"], s["steps"], s["tokens"]) == (2, 16, 16 * 96), s
    assert (s["steps_rolled_back"], s["tokens_processed"]) == (2, 18 * 96), s


def test_a_missing_command_is_exit_2_and_creates_nothing(tmp_path):
    for cmd in (["no-such-program-here"], [sys.executable, "missing.py"], [str(tmp_path)]):
        p = start_gptop("--no-ui", "run", "--", *cmd, cwd=tmp_path)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2 and "CMD:" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_lightning_script(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import lightning"], env=gptop_env(), capture_output=True)
    if probe.returncode != 0:
        pytest.skip("Lightning is an optional extra: pip install 'gptop[lightning]'")
    p = start_gptop(
        "--no-ui",
        "--json",
        "run",
        "--run-dir",
        "run",
        "--log-every",
        "5",
        "--",
        sys.executable,
        str(EXAMPLES / "train_lightning.py"),
        "--steps",
        "10",
        "--out",
        "pl",
        cwd=tmp_path,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    steps = [e for e in map(parse, out.splitlines()) if e.type == "step"]
    assert [e.step for e in steps] == [5, 10] and all(e.loss is not None and e.phases_ms for e in steps)


def test_two_ranks_stop_on_the_same_step(tmp_path):
    """torchrun as the command: each rank's probe reports with its rank, and a stop lands on one step."""
    run = tmp_path / "run"
    p = start_gptop(
        "--no-ui",
        "run",
        "--run-dir",
        "run",
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "tests" / "fixtures" / "ddp_loop.py"),
        "--out",
        "ckpt",
        cwd=tmp_path,
    )
    rank1 = run / "events.rank1.jsonl"
    wait_for(
        lambda: run_events(run, "step") and rank1.exists() and rank1.stat().st_size,
        timeout=300,
        what="step events of both ranks",
    )
    pids = [e.pid for e in run_events(run, "hello") if e.client is not None]
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, out + err
    done = run_events(run, "done")[-1]
    last = {0: run_events(run, "step")[-1].step, 1: [e for e in read_events(rank1) if e.type == "step"][-1].step}
    assert last == {0: done.step, 1: done.step}, (last, done)  # both ranks stopped after the same step
    ckpt = run_events(run, "checkpoint")[-1]
    assert ckpt.reason == "stop" and ckpt.step == done.step and Path(ckpt.path).exists()
    steps = run_events(run, "step")
    assert steps[-1].tokens == steps[-1].step * 2 * 4 * 16 and {e.rank for e in read_events(rank1)} == {1}
    # the probe's hooks on the DDP module: the breakdown from one probe.step call per step
    assert all(e.phases_ms[p] > 0 for e in steps for p in ("forward", "backward", "optimizer"))
    assert client_hello(run).model.family == "Sequential"  # the module inside DDP
    assert all(gone(pid) for pid in pids)


def test_the_dashboard_shows_a_loop_and_q_stops_it(tmp_path):
    from fixtures.terminal import Terminal
    from test_tui_terminal import screen_text

    run = tmp_path / "run"
    term = Terminal(
        [
            sys.executable,
            "-m",
            "gptop",
            "run",
            "--run-dir",
            str(run),
            "--log-every",
            "2",
            "--",
            sys.executable,
            str(EXAMPLES / "train_loop.py"),
            "--steps",
            "100000",
            "--step-sleep",
            "0.02",
            "--out",
            str(tmp_path / "ckpt"),
        ],
        cols=120,
        rows=40,
        env=dict(gptop_env(), TERM="xterm-256color", COLUMNS="120", LINES="40"),
    )
    try:
        wait_for(lambda: run_events(run, "step"), timeout=300, what="a step event")
        wait_for(lambda: "LlamaForCausalLM" in screen_text(term)[-20000:], timeout=60, what="the client's hello")
        pid = client_hello(run).pid
        term.send(b"q")
        assert term.proc.wait(120) == 130
    finally:
        term.close()
    assert gone(pid) and run_events(run, "checkpoint")[-1].reason == "stop"
    text = screen_text(term)
    assert "gptop: run stopped by you at step" in text and "command" in text
