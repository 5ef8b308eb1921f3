"""The --no-ui view: JSON lines, readable lines, and no Textual on its import path."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.streams import cpu_run, ev, gpu_logs, gpu_run
from fixtures.terminal import TextStream
from gptop.headless import HeadlessView, event_line, first_step_line, step_line
from gptop.state import RunState
from trainer.contract.events import DeviceEvent, StatusEvent, StepEvent, dumps, parse

ROOT = Path(__file__).resolve().parents[1]


def play(view: HeadlessView, state: RunState, events, logs=(), final: tuple[str, str | None] | None = None):
    """What a Session does: apply to the state, then tell the view."""
    state.set_status("running")
    view.on_status("running")
    for e in events:
        state.apply(e)
        view.on_event(e)
    for stream, line in logs:
        state.add_log(line, stream)
        view.on_log(line, stream)
    if final:
        state.set_status(*final)
        view.on_status(*final)
    view.close()


def test_json_mode_prints_every_event_as_a_parseable_line_and_nothing_else():
    out, err = io.StringIO(), io.StringIO()
    state = RunState()
    events = gpu_run(failed=True)
    play(
        HeadlessView(state, json=True, stream=out, err=err),
        state,
        events,
        gpu_logs(True),
        ("failed", "trainer exited with code 1"),
    )
    lines = out.getvalue().splitlines()
    parsed = [parse(line) for line in lines]  # every line is a valid event
    trainer = [p for p in parsed if not isinstance(p, StatusEvent)]
    assert trainer == events  # and the same event, field for field
    statuses = [p for p in parsed if isinstance(p, StatusEvent)]
    assert [s.status for s in statuses] == ["running", "failed"]
    assert statuses[-1].message == "trainer exited with code 1"
    assert "Traceback" not in out.getvalue()  # trainer logs never on stdout in JSON mode
    assert "Traceback (most recent call last):" in err.getvalue()  # the failure's stderr tail goes to stderr


def test_json_mode_thins_device_samples_by_event_time():
    out = io.StringIO()
    state = RunState()
    events = cpu_run()
    play(HeadlessView(state, json=True, stream=out, device_interval=5.0), state, events)
    parsed = [json.loads(line) for line in out.getvalue().splitlines()]
    devices = [p for p in parsed if p["type"] == "device"]
    all_devices = [e for e in events if isinstance(e, DeviceEvent)]
    assert 0 < len(devices) <= len(all_devices) // 5 + 1
    assert all(b["time"] - a["time"] >= 5.0 for a, b in zip(devices, devices[1:]))
    assert len([p for p in parsed if p["type"] == "step"]) == len([e for e in events if isinstance(e, StepEvent)])


def test_readable_lines():
    out, err = io.StringIO(), io.StringIO()
    state = RunState(run_dir="runs/x")
    play(
        HeadlessView(state, json=False, stream=out, err=err),
        state,
        gpu_run(failed=True, tuning_done=True),
        gpu_logs(True),
        ("failed", "trainer exited with code 1"),
    )
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0] == "status: running"
    assert lines[1].startswith("gptop: deepseek medium · 887.4M params (344.8M active) on NVIDIA H100")
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 30
    assert steps[0].startswith(
        "step 10/1000 loss 9.698 | 32.5k tok/s | mfu 30.5% | step 252 ms (data 3% fwd 29% "
        "bwd 56% opt 10% other 3%) gpu idle 6% | mem 19.0 GB"
    )
    assert steps[-1].endswith("| eta 2:55")
    for expected in (
        "eval step 100 loss 3.992",
        "checkpoint step 200 -> runs/fixture/checkpoints/step_000200.pt (1.4 s)",
        "warning: loss spike at step 150",
        "error [oom]: CUDA out of memory",
        "trial 1 ok: compile=default fused_adamw=on | 41.9k tok/s ±1.8% | peak 36.0 GB | +28.8% tokens/s",
        "baseline 0 ok: (as started) | 32.5k tok/s ±1.2%",
        "trial 2 infeasible: compile=default micro_batch=32 | peak 79.0 GB | oom: rolled back",
        "apply: compile=default fused_adamw=on | 41.9k tok/s, 1.29x (1.22-1.36x) the start's 32.5k",
        "tuner: find micro batch (30:00 budget left)",
        "tuner: done",
        "hint: compute-bound",
        "status: failed: trainer exited with code 1",
    ):
        assert expected in text, expected
    assert not any(line.startswith("{") for line in lines)
    assert "UserWarning" not in text  # trainer logs are not echoed by default
    assert "last 5 lines of the trainer's stderr:" in err.getvalue() and "loss.backward()" in err.getvalue()
    assert "\x1b[" not in text  # not a TTY: no progress bar, no escapes


class Flushes(io.StringIO):
    """A stream that counts its flushes."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def test_readable_mode_echoes_logs_when_asked_and_only_prints_primary_rank_steps():
    out, err = io.StringIO(), io.StringIO()
    state = RunState()
    play(HeadlessView(state, json=False, stream=out, err=err, echo_logs=True), state, gpu_run(60, ranks=2), gpu_logs())
    assert "[err] UserWarning: TypedStorage is deprecated" in out.getvalue() and not err.getvalue()
    steps = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert len(steps) == 6 and all("ranks" in line for line in steps[1:])  # rank 1 arrives after rank 0


def test_a_programs_lines_are_echoed_prefixed_in_order_and_flushed_soon_not_per_line():
    """`gptop --no-ui run -- CMD`: the program's lines among gptop's own, in the order they came, each stream
    prefixed; thousands of them cost a few flushes, not one write and flush each; the last ones are flushed
    within ECHO_FLUSH_S even when nothing else is printed; with --json they go to stderr, stdout stays JSON."""
    import time

    from gptop.headless import ECHO_FLUSH_S

    out, err = Flushes(), io.StringIO()
    state = RunState()
    view = HeadlessView(state, json=False, stream=out, err=err, echo_logs=True)
    view.on_status("running")
    view.on_log("[gptop] note", "gptop")
    for i in range(5000):
        view.on_log(f"iter {i}", "stdout")
    view.on_log("Traceback (most recent call last):", "stderr")
    view.on_status("failed", "python train.py failed (exit code 1)")
    view.on_log("late", "stdout")
    time.sleep(ECHO_FLUSH_S * 3)
    assert out.getvalue().endswith("[out] late\n")  # flushed by the timer: nothing else was printed
    view.close()
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["status: running", "[out] iter 0"] and "gptop: note" in err.getvalue()  # gptop's: stderr
    assert [x for x in lines if x.startswith("[out] iter")] == [f"[out] iter {i}" for i in range(5000)]
    i = lines.index("[err] Traceback (most recent call last):")
    assert lines[i - 1] == "[out] iter 4999" and lines[i + 1].startswith("status: failed")
    assert out.flushes < 50  # not one per line
    assert "last 1 lines" not in err.getvalue()  # echoed already: no stderr tail repeated

    out, err = io.StringIO(), io.StringIO()
    view = HeadlessView(RunState(), json=True, stream=out, err=err, echo_logs=True)
    view.on_log("iter 1", "stdout")
    view.close()
    assert err.getvalue() == "[out] iter 1\n" and out.getvalue() == ""


def test_cpu_run_lines_say_na_for_missing_numbers():
    state = RunState()
    for e in cpu_run():
        state.apply(e)
    line = step_line(state.last_step, state)
    assert "mfu n/a" in line and "idle" not in line
    assert event_line(ev("device", 1.0, devices=[]), state) is None
    assert event_line(ev("done", 100.0, step=120, tokens=122880), state).startswith("done: step 120, 122.9k tokens")


def test_progress_bar_on_a_tty():
    out = TextStream(tty=True)
    state = RunState()
    view = HeadlessView(state, json=False, stream=out)
    assert view._progress is not None
    play(view, state, cpu_run())
    assert "step 120/200" in out.getvalue()
    json_view = HeadlessView(RunState(), json=True, stream=TextStream(tty=True))  # never a bar in JSON mode
    assert json_view._progress is None


@pytest.mark.process
def test_headless_does_not_import_textual():
    code = (
        "import sys; import gptop.headless, gptop.state, gptop.controls; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'textual' or m.startswith('gptop.ui')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# --- issue 11: startup phases, the estimate, progress between log steps ---------------------------------------


def test_startup_lines_say_what_it_costs_and_what_it_does():
    from fixtures.streams import startup_run

    out = io.StringIO()
    state = RunState(run_dir="runs/x")
    play(HeadlessView(state, json=False, stream=out), state, startup_run("steps"))
    lines = out.getvalue().splitlines()
    # a slow estimate is said once, by the warning line that follows (issue 26)
    assert lines[1] == (
        "starting: deepseek medium · 887.4M params (344.8M active) on AMD EPYC 7763 64-Core Processor, 200 steps"
    )
    assert lines[2] == (
        "warning: deepseek medium on this CPU: ~14.8 GiB (optimizer 6.6 GiB), ~1.8 min per step, "
        "~6.1 h for 200 steps (estimated at 40% MFU)"
    )
    startup = [line for line in lines if line.startswith("startup: ")]
    assert startup == [
        "startup: tokenizing builtin",  # once, not per percent
        "startup: building deepseek medium",
        "startup: probing micro-batch 1",
        "startup: probing micro-batch 2",
        "startup: compiling (torch.compile default)",
    ]
    assert sum(line.startswith("gptop: deepseek medium") for line in lines) == 1
    steps = [line.split(" loss")[0] for line in lines if line.startswith("step ")]
    assert steps == ["step 1/200 done in 95.0 s (warm-up included); a line every 10 steps", "step 10/200"]


def test_progress_events_move_the_bar_and_are_json_lines():
    from fixtures.streams import startup_run

    out = TextStream(tty=True)
    state = RunState()
    play(HeadlessView(state, json=False, stream=out), state, startup_run("steps"))
    assert "13/200" in out.getvalue()  # the bar moved past the last step line (10)
    out = io.StringIO()
    state = RunState()
    play(HeadlessView(state, json=True, stream=out), state, startup_run("steps"))
    kinds = [json.loads(line)["type"] for line in out.getvalue().splitlines()]
    assert kinds.count("progress") == 13 and kinds.count("phase") == 7 and kinds.count("hello") == 2


def test_no_first_step_line_when_every_step_has_one():
    from fixtures.streams import startup_run

    state = RunState()
    for e in startup_run("steps"):
        state.apply(e)
    state.hello.config["log"]["log_every"] = 1
    assert first_step_line(ev("progress", 1.0, step=1, tokens=1), state) is None
    state.hello.config["log"]["log_every"] = 10
    assert first_step_line(ev("progress", 1.0, step=10, tokens=1), state) is None  # a log step: its own line
    assert first_step_line(ev("progress", 1.0, step=1, tokens=1), state).startswith("step 1/200 done")


class ClosedPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_is_noted_not_raised():
    """`gptop --no-ui ... | head`: the first failed write sets stdout_closed (the CLI then stops the run)
    and nothing more is written or raised, from any thread that prints."""
    state = RunState()
    view = HeadlessView(state, json=False, stream=ClosedPipe(), err=io.StringIO())
    play(view, state, cpu_run(30), final=("done", None))
    assert view.stdout_closed.is_set()


@pytest.mark.slow
@pytest.mark.process
def test_gptop_piped_into_head_exits_quietly(tmp_path):
    """A replay's JSON lines (more than a pipe buffer) into a reader that stops after one line: exit 141
    as for SIGPIPE, no traceback."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "events.jsonl", "w") as f:
        for _ in range(4):  # ~200 kB: the writer blocks on a full pipe, then gets EPIPE
            for e in gpu_run():
                f.write(dumps(e) + "\n")
    p = subprocess.Popen(
        [sys.executable, "-m", "gptop", "--no-ui", "--json", "--run-dir", str(run)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout.readline().startswith(b"{")
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.process
def test_without_a_terminal_gptop_prints_the_lines_of_no_ui(tmp_path):
    """Output to a pipe and no keyboard (stdin /dev/null): the same lines as `--no-ui`, not a dashboard drawn
    into a pipe, and one line on stderr saying why."""
    run = tmp_path / "run"
    run.mkdir()
    events = cpu_run(steps=30) + [ev("done", 40.0, step=30, tokens=30 * 1024, reason="max_steps")]
    (run / "events.jsonl").write_text("".join(dumps(e) + "\n" for e in events))

    def monitor(*flags: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "gptop", *flags, "--run-dir", str(run)]
        return subprocess.run(argv, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)

    plain, no_ui = monitor(), monitor("--no-ui")
    assert plain.returncode == no_ui.returncode and plain.stdout == no_ui.stdout, plain.stderr
    assert "step 30" in plain.stdout and "\x1b[" not in plain.stdout
    assert plain.stderr.splitlines() == [
        "gptop: no terminal (stdin or stdout is not a tty): printing lines, as with --no-ui"
    ]
    assert no_ui.stderr == ""


def measuring(t: float, samples: int, warmed_up: bool = True, kind: str = "baseline", number=None):
    return ev(
        "tuner",
        t,
        phase="baseline" if kind == "baseline" else "trials",
        budget_left_s=500.0,
        trial=number,
        measure={
            "kind": kind,
            "number": number,
            "steps": samples + 3,
            "samples": samples,
            "needed": 8,
            "warmed_up": warmed_up,
            "tokens_per_s": 4000.0 if samples else None,
            "spread": 600.0 if samples else None,
            "target": 0.03,
            "seconds": t,
            "max_seconds": 90.0,
        },
    )


def test_the_tuners_measurement_is_a_line_when_it_starts_warms_up_and_every_ten_seconds():
    out = io.StringIO()
    state = RunState()
    events = [measuring(0.0, 0, warmed_up=False)]
    events += [measuring(t, 0, warmed_up=False) for t in (1.0, 2.0)]  # still warming up: quiet
    events += [measuring(3.0 + t, 1 + t) for t in range(12)]  # warmed up at 3 s, then 13 s
    events += [ev("tuner", 16.0, phase="trials", budget_left_s=400.0, trial=None)]  # it ended: no line
    events += [measuring(17.0, 0, warmed_up=False, kind="trial", number=1)]  # the next one: a line
    play(HeadlessView(state, json=False, stream=out), state, events)
    lines = [l for l in out.getvalue().splitlines() if l.startswith("tuner: measuring")]
    assert lines == [
        "tuner: measuring baseline: warming up, 3 steps · 0:00/1:30",
        "tuner: measuring baseline: 1/8 samples · 4.0k tok/s ±15.0% (goal ±3%) · 0:03/1:30",
        "tuner: measuring baseline: 11 samples · 4.0k tok/s ±15.0% (goal ±3%) · 0:13/1:30",
        "tuner: measuring trial 1: warming up, 3 steps · 0:17/1:30",
    ]


def test_a_trainer_stop_is_not_printed_as_the_runs_end():
    state = RunState()
    for e in gpu_run(120):
        state.apply(e)
    state.apply(measuring(300.0, 4, kind="trial", number=2))

    def line_of(e):  # as a session does: the state first, then the view
        state.apply(e)
        return event_line(e, state)

    line = line_of(ev("done", 301.0, step=120, tokens=120 * 32 * 256, reason="stop requested"))
    assert line == "trainer stopped at step 120 to restart with the next settings (tuning)"
    state.apply(ev("tuner", 302.0, phase="done", budget_left_s=0.0, trial=None))
    line = line_of(ev("done", 303.0, step=125, tokens=128_000, reason="stop requested"))
    assert line == "trainer stopped at step 125 (stop requested), 128.0k tokens"
    assert line_of(ev("done", 304.0, step=1000, tokens=1_024_000, reason="max_steps")).startswith("done: step 1000")


def test_a_refusal_before_the_first_step_is_said_once():
    """A configuration the trainer refuses before its first step (a corpus too small for --seq-len) ends the
    command with one `gptop: error: ...` line: the stream neither prints the error event nor repeats it in
    the status line. After a step, a config error is part of the run's story and is printed."""
    said = "--data: corpus too small: 16 tokens, but --seq-len 256 needs at least 1,025 training tokens"
    state, out = RunState(), io.StringIO()
    view = HeadlessView(state, json=False, stream=out)
    play(
        view,
        state,
        [cpu_run(0)[0], ev("error", 1.0, kind="config", message=said)],
        final=("failed", f"trainer failed (exit code 2): config: {said}"),
    )
    text = out.getvalue()
    assert said not in text and "status: failed\n" in text
    later, out = RunState(), io.StringIO()
    view = HeadlessView(later, json=False, stream=out)
    play(
        view,
        later,
        cpu_run(20) + [ev("error", 99.0, kind="config", message="--lr: refused mid-run")],
        final=("failed", "trainer failed (exit code 2): config: --lr: refused mid-run"),
    )
    assert out.getvalue().count("--lr: refused mid-run") == 2
    js, out = RunState(), io.StringIO()  # --json keeps every event as it came
    view = HeadlessView(js, json=True, stream=out)
    play(view, js, [cpu_run(0)[0], ev("error", 1.0, kind="config", message=said)], final=("failed", said))
    assert [json.loads(line)["type"] for line in out.getvalue().splitlines()].count("error") == 1
