"""Every run's end is recorded: `gptop run -- CMD` of a script without a gptop client, as a user runs it (real
processes), through exit 0, a non-zero exit, a traceback, a stop by the user and a SIGKILL of the script. Each end
is gptop's `exit` event in events.jsonl, read back by `gptop report` and said by the summary; `--no-ui` shows the
script's own lines unless `--quiet`; export and sample refuse a program's run."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from helpers import gone, run_events, start_gptop, wait_for
from trainer.contract.events import parse

pytestmark = [pytest.mark.slow, pytest.mark.process]

SLEEPER = "import time; print('up', flush=True); time.sleep(600)"
# case -> (the script, gptop's exit code, the exit event's (exit_code, signal, stopped_by), the summary's head,
# the report's state line)
CASES = {
    "exit-0": (
        "import sys; print('working'); print('a warning', file=sys.stderr)",
        0,
        (0, None, None),
        "gptop: run finished after",
        "state     finished (exit 0) after",
    ),
    "exit-3": (
        "import sys; print('something broke', file=sys.stderr); sys.exit(3)",
        1,
        (3, None, None),
        "gptop: run failed (exit 3) after",
        "state     failed (exit 3) after",
    ),
    "traceback": (
        "print('starting'); 1 / 0",
        1,
        (1, None, None),
        "gptop: run failed (exit 1) after",
        "ZeroDivisionError: division by zero",
    ),
    "user-stop": (
        SLEEPER,
        130,
        (None, signal.SIGINT, "user"),  # SIGINT ends a Python script that does not catch it
        "gptop: run stopped by you after",
        "state     stopped by you (signal 2 (SIGINT)) after",
    ),
    "sigkill": (
        SLEEPER,
        1,
        (None, signal.SIGKILL, None),
        "gptop: run killed by signal 9 (SIGKILL) after",
        "state     killed by signal 9 (SIGKILL) after",
    ),
}


def report(run: Path, *args: str) -> tuple[int, str]:
    p = start_gptop(*args, "report", str(run), cwd=run.parent)
    out, err = p.communicate(timeout=120)
    return p.returncode, out + err


@pytest.mark.parametrize("case", CASES)
def test_a_commands_end_is_recorded_and_read_back(tmp_path, case):
    script, code, (exit_code, sig, by), head, state = CASES[case]
    run = tmp_path / "run"
    p = start_gptop(
        "--no-ui", "run", "--run-dir", "run", "--grace", "30", "--", sys.executable, "-c", script, cwd=tmp_path
    )
    if script is SLEEPER:
        log = run / "trainer.log"
        wait_for(lambda: log.exists() and "up" in log.read_text(), timeout=120, what="the script to start")
        wait_for(lambda: run_events(run, "hello"), timeout=60, what="gptop's record of the start")
        pid = run_events(run, "hello")[0].pid
        if case == "user-stop":
            p.send_signal(signal.SIGINT)  # Ctrl-C to gptop
        else:
            os.kill(pid, signal.SIGKILL)  # the script dies, gptop does not
    out, err = p.communicate(timeout=180)
    assert p.returncode == code, out + err

    (end,) = run_events(run, "exit")  # one process, one end: gptop's record, after its start's
    assert [e.type for e in run_events(run)] == ["hello", "exit"]
    assert (end.exit_code, end.signal, end.stopped_by) == (exit_code, sig, by), end
    assert end.pid == run_events(run, "hello")[0].pid and end.seconds is not None and end.seconds >= 0
    assert not end.stderr or (by is None and code == 1)  # a failure's last words, and only a failure's
    if case in ("exit-3", "traceback"):
        assert end.stderr[-1] in ("something broke", "ZeroDivisionError: division by zero"), end.stderr

    summary = out[out.index("gptop: run ") :]
    assert summary.startswith(head), summary
    assert "steps not reported: add a gptop client" in summary and "no step was completed" not in summary
    assert "checkpoint not reported" in summary and "checkpoint none" not in summary

    rc, text = report(run)
    assert rc == (1 if code == 1 else 0), text
    assert state in text, text
    assert "model     unknown: not reported" in text and "0.0M params" not in text
    assert "progress  steps not reported" in text and "no step done" not in text
    assert "ended without a word" not in text
    assert ("errors    none" in text) == (not end.stderr), text
    if end.stderr:
        assert f"            {end.stderr[-1]}" in text  # its last stderr lines
    rc, text = report(run, "--json")
    s = json.loads(text)
    assert s["exit"]["exit_code"] == exit_code and s["exit"]["words"] in text and s["client"] is None

    for tool in (["export", "run", "out"], ["sample", "run", "--prompt", "hi"]):  # a program's own checkpoints
        t = start_gptop(*tool, cwd=tmp_path)
        t_out, t_err = t.communicate(timeout=120)
        assert t.returncode == 2 and "is a run of your own program" in t_err and "Traceback" not in t_err, t_err
        assert len(t_err.strip().splitlines()) == 1 and "made no checkpoint" not in t_err
    assert not (tmp_path / "out").exists()


def test_no_ui_prints_the_scripts_lines_in_order_unless_quiet(tmp_path):
    """CI logs show a script's progress: its lines, each stream in its order, prefixed as its stream, after gptop's
    start line and before the summary; `--quiet` leaves them out; with `--json` they go to stderr."""
    script = (
        "import sys, time\n"
        "for i in range(2000): print(f'iter {i}')\n"
        "sys.stdout.flush(); time.sleep(0.5)\n"
        "for i in range(3): sys.stderr.write(f'\\r{i}/3 bar'); sys.stderr.flush()\n"
        "sys.stderr.write('\\n'); print('bye')\n"
    )
    p = start_gptop("--no-ui", "run", "--run-dir", "a", "--", sys.executable, "-c", script, cwd=tmp_path)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, out + err
    lines = out.splitlines()
    shown = [x for x in lines if x.startswith("[out] ")]
    assert shown == [f"[out] iter {i}" for i in range(2000)] + ["[out] bye"]
    assert "[err] 2/3 bar" in lines and "[err] 0/3 bar" not in out  # a redrawn line: its last drawing
    first, summary = lines.index("[out] iter 0"), next(i for i, x in enumerate(lines) if x.startswith("gptop: run"))
    assert lines[0].startswith("starting: ") and first < lines.index("[out] iter 1999") < summary
    assert max(i for i, x in enumerate(lines) if x.startswith("[")) < summary

    p = start_gptop("--no-ui", "run", "--quiet", "--run-dir", "b", "--", sys.executable, "-c", script, cwd=tmp_path)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0 and "[out]" not in out + err and "iter 5" not in out + err, out + err
    assert "iter 1999" in (tmp_path / "b" / "trainer.log").read_text()  # all of it is in the run directory

    p = start_gptop("--no-ui", "--json", "run", "--run-dir", "c", "--", sys.executable, "-c", script, cwd=tmp_path)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    assert all(parse(line) for line in out.splitlines())  # stdout stays JSON lines
    assert "[out] iter 1999" in err.splitlines() and any(parse(x).type == "exit" for x in out.splitlines())


def test_a_restarted_command_has_an_exit_per_process(tmp_path):
    """--restart-on-failure: each process gptop starts ends with its own `exit` (the failure, then the restart's
    end), and the report says how the last one ended."""
    flag = tmp_path / "failed-once"
    script = (
        f"import os, sys; p = {str(flag)!r}\nif not os.path.exists(p): open(p, 'w').close(); sys.exit(5)\nprint('ok')"
    )
    p = start_gptop(
        "--no-ui",
        "run",
        "--run-dir",
        "run",
        "--restart-on-failure",
        "1",
        "--",
        sys.executable,
        "-c",
        script,
        cwd=tmp_path,
    )
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, out + err
    run = tmp_path / "run"
    assert [(e.exit_code, e.stopped_by) for e in run_events(run, "exit")] == [(5, None), (0, None)]
    kinds = [e.type for e in run_events(run) if e.type in ("hello", "exit")]
    assert kinds == ["hello", "exit", "hello", "exit"]  # each end before the next start
    rc, text = report(run)
    assert rc == 0 and "state     finished (exit 0)" in text and "2 start(s)" in text, text
    assert all(gone(e.pid, timeout=10) for e in run_events(run, "hello"))
