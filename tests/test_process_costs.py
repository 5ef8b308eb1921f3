"""trainer.process_costs: a trainer process skips the interpreter's teardown after its exit handlers, and pauses
the cyclic GC only while it imports, so building the model and the training loop collect as any program does."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, train_in_process

# A process that imports the trainer package, registers a buffered writer's exit handler after the package's,
# holds an object whose __del__ says when the interpreter tears it down, leaves a line without its newline,
# then ends as its second argument says: with a recorded code ("fast"), without one ("plain"), or raising.
SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from trainer.process_costs import set_exit_code  # importing the package registers the exit handler
    out = open(sys.argv[1], "w")
    atexit.register(lambda: (out.write("handler ran"), out.close()))
    class Teardown:
        def __del__(self):
            sys.stderr.write("teardown ran")
    kept = Teardown()
    print("partial line", end="")
    if sys.argv[2] == "raise":
        raise RuntimeError("boom")
    sys.exit(3 if sys.argv[2] == "plain" else set_exit_code(3))
    """
)


def run_script(tmp_path, how: str) -> tuple[subprocess.CompletedProcess, str]:
    marker = tmp_path / f"{how}.txt"
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(marker), how], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    return p, marker.read_text() if marker.exists() else ""


@pytest.mark.process
def test_a_returned_code_exits_after_every_exit_handler_and_skips_only_the_teardown(tmp_path):
    plain, plain_marker = run_script(tmp_path, "plain")
    assert plain.returncode == 3 and "teardown ran" in plain.stderr  # no code recorded: Python's own teardown
    fast, marker = run_script(tmp_path, "fast")
    assert fast.returncode == 3, fast.stderr
    assert marker == plain_marker == "handler ran"  # a handler registered later ran, its file complete
    assert fast.stdout == "partial line"  # the unfinished line reached the pipe
    assert "teardown ran" not in fast.stderr


@pytest.mark.process
def test_an_exception_tears_down_as_python_does(tmp_path):
    p, marker = run_script(tmp_path, "raise")
    assert p.returncode == 1 and "RuntimeError: boom" in p.stderr
    assert marker == "handler ran" and p.stdout == "partial line"
    assert "teardown ran" in p.stderr


@pytest.fixture
def restored_gc():
    enabled = gc.isenabled()
    try:
        yield
    finally:
        gc.unfreeze()  # this worker's objects back under collection
        (gc.enable if enabled else gc.disable)()


def test_resume_without_a_pause_changes_nothing(restored_gc):
    from trainer import process_costs

    frozen = gc.get_freeze_count()
    process_costs.resume_gc()  # a trainer inside another program: its GC is that program's
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()
    process_costs.pause_gc_for_startup()
    process_costs.resume_gc()  # a program that runs without the GC keeps it off
    assert not gc.isenabled() and gc.get_freeze_count() == frozen


def test_the_trainer_resumes_collection_before_it_builds_its_model(tmp_path, restored_gc):
    """The pause ends in startup, before the model, on every path to the loop: a run of weeks collects its
    garbage."""
    from trainer import process_costs

    process_costs.pause_gc_for_startup()
    assert not gc.isenabled()
    code, events, _ = train_in_process(tmp_path / "run", "--model", "llama", "--max-steps", "1")
    assert code == 0 and events[-1].type == "done"
    assert gc.isenabled() and gc.get_freeze_count() > 0


@pytest.mark.parametrize(
    "argv, ours",
    [
        (["python", "-m", "trainer", "--max-steps", "2"], True),
        (["python", "-u", "-m", "trainer", "--max-steps", "2"], True),  # torchrun's ranks
        (["python", "-X", "importtime", "-W", "ignore", "-m", "trainer.export", "RUN", "OUT"], True),
        (["python", "-m", "trainer.sample", "RUN"], True),
        (["python", "-m", "trainer.doctor"], False),  # imports torch check by check: nothing to pause for
        (["python", "-m", "gptop", "train"], False),
        (["python", "-m", "pytest", "-m", "trainer"], False),  # the first -m is the one Python runs
        (["python", "-c", "import trainer", "-m", "trainer"], False),
        (["python", "script.py", "-m", "trainer"], False),
        (["python", "-mtrainer"], False),  # a spelling not followed: no pause, nothing else
        (["python", "-m"], False),
    ],
)
def test_only_the_pausing_entry_points_pause_at_the_packages_import(argv, ours):
    from trainer import process_costs

    assert process_costs.started_as(process_costs.PAUSING_ENTRY_POINTS, argv) is ours


def test_this_test_process_did_not_pause_when_it_imported_the_trainer():
    import trainer  # noqa: F401

    assert gc.isenabled()


def test_a_tool_resumes_collection_when_it_loads_its_model(tmp_path, restored_gc):
    """`python -m trainer.export` and `.sample` pause from the package's import; loading the model resumes."""
    from trainer import process_costs
    from trainer.contract import rundir
    from trainer.model_loading import load_for_inference

    code, _, run_dir = train_in_process(tmp_path / "run", "--model", "llama", "--max-steps", "1")
    assert code == 0
    process_costs.pause_gc_for_startup()
    assert not gc.isenabled()
    loaded = load_for_inference(run_dir, rundir.list_checkpoints(run_dir)[::-1], log=lambda _: None)
    assert loaded.step == 1
    assert gc.isenabled()
