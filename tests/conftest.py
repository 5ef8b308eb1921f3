import gc
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

# One small, shared cache for the whole test session: the builtin tokenizer is trained
# once on a ~300 KB slice of the stdlib instead of the full default corpus.
_CACHE = Path(os.environ.get("GPTOP_TEST_CACHE", Path(__file__).resolve().parent.parent / ".pytest-gptop-cache"))
os.environ.setdefault("GPTOP_CACHE", str(_CACHE))
os.environ.setdefault("GPTOP_BUILTIN_BYTES", "300000")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _ram_temproot(min_free: int = 8 * 2**30) -> str | None:
    """/dev/shm where it is a writable RAM disk with `min_free` bytes free (not a container's 64 MB one)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize >= min_free and os.access("/dev/shm", os.W_OK) else None


# The tests' tmp_path on a RAM disk where there is one with room: the suite writes gigabytes of checkpoints, each
# fsynced, and on a small machine's disk the tests then wait on its writeback. A passed test's directory is
# removed when it ends (pyproject.toml: tmp_path_retention_policy), so little stays in memory.
# PYTEST_DEBUG_TEMPROOT, pytest's own setting, chooses another place (=/tmp: the disk).
if (_ram := _ram_temproot()) is not None:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", _ram)

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the
# threads fight each other (measured 3-8x slower); trainer subprocesses inherit this, and torch reads it
# when a test first imports it (not here: pytest's controller under -n runs no test and needs no torch).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A test worker holds a large, long-lived heap (torch, transformers, Textual, the parsed sources) that every full
# collection walks again while almost none of it is garbage: full collections a hundred times rarer than Python's
# default (the younger generations unchanged) cost a worker some memory and save it CPU (BENCHMARKS.md §17).
# Processes the tests start keep Python's default.
_young, _middle, _ = gc.get_threshold()
gc.set_threshold(_young, _middle, 1000)

from fixtures import cpu_share  # noqa: E402
from helpers import TINY  # noqa: E402  (the shared helpers: tests/helpers.py)

_CPU_LOCK = pytest.StashKey[Path]()


@pytest.fixture
def tiny_args():
    return list(TINY)


@pytest.fixture
def gptop(tmp_path, monkeypatch):
    """gptop's end of the client channel in this process (tests/fixtures/fake_gptop.py), with a run directory and
    the environment `gptop run` gives a command: for the integrations' tests, which run a training loop here."""
    from fixtures.fake_gptop import FakeGptop

    g = FakeGptop(tmp_path / "run").install(monkeypatch)
    yield g
    g.close()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy CI box OpenMP spinning makes them slower
    (`pytestmark = pytest.mark.usefixtures("one_thread")` in a module of in-process model tests)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the `process` marker: the inner loop (`-m "not process"`) starts no process ---------------------------
# Every test that starts a process (a trainer, gptop, torchrun, any subprocess, a fork, a DataLoader worker)
# is marked `process`; a test that starts one without the marker fails here, so the tier that runs in
# seconds stays free of process start-up times and of leftover processes.


def _no_process(what: str):
    def refuse(*args, **kwargs):
        pytest.fail(f"this test starts a process ({what}) but is not marked @pytest.mark.process", pytrace=False)

    return refuse


@pytest.fixture(autouse=True)
def _process_guard(request, monkeypatch):
    if request.node.get_closest_marker("process") is None:
        import multiprocessing.process
        import subprocess

        monkeypatch.setattr(subprocess.Popen, "_execute_child", _no_process("subprocess"))
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _no_process("multiprocessing"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, _no_process(f"os.{name}"))
    yield


# --- pytest -n 2: tests that measure speed get the CPU to themselves (tests/fixtures/cpu_share.py) --------------


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controlling process (or the only one)
        config.stash[_CPU_LOCK] = cpu_share.make()


def pytest_unconfigure(config):
    path = config.stash.get(_CPU_LOCK, None)
    if path is not None:
        cpu_share.remove(path)
        os.environ.pop(cpu_share.ENV, None)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Let pytest keep the assertion-rewritten bytecode of the test modules (and Python that of the modules they
    import) while it collects, also where PYTHONDONTWRITEBYTECODE is set: without that cache every worker rewrites
    every test module again on every run, most of collection's time. Tests run under the environment's choice."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Collect the session's garbage once (a finalizer's error still reaches pytest, whose hook is still in place),
    then freeze what is left: pytest's repeated collections at exit and the interpreter's shutdown no longer walk
    the whole heap again, seconds of every run's end."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    solo, process = item.get_closest_marker("solo"), item.get_closest_marker("process")
    # the test's node id names it in the wait log: PYTEST_CURRENT_TEST is set only once its setup begins
    with cpu_share.hold(cpu_share.EXCLUSIVE if solo else cpu_share.SHARED if process else 0, item.nodeid):
        return (yield)


# The order xdist hands out the files in (`pytest -n 2 --dist loadfile --no-loadscope-reorder`: each worker takes the
# next file when its own is nearly done), so that a test holding the CPU alone runs while the other worker has
# in-process tests to run beside it (a steady load, and no process test waiting for the CPU):
#   0. the files of `solo` tests (the CPU alone for the whole test): one worker starts with them...
#   1. ...while the other works through the in-process files marked `waits` (their load comes and goes as they
#      wait on timers; the solo test, a tuning under bursts of load, is built for that), those with the most tests
#      first (so that none is still running when the measuring starts), then a few others;
#   2. the files of `measures` tests (the CPU alone from their start until the tuner decided): when the solo ones
#      are done, with the rest of the in-process files to run beside them;
#   3. the rest of the in-process files: their load holds still, as the tuner of run A (tests/test_tuning_e2e.py)
#      needs for the start and the trials it compares (a measurement beside a file that waits and one beside a file
#      that computes are two loads, and it rightly compares neither); they must outlast its measuring, since once
#      they run out the other worker waits and the load drops too;
#   4. the files that start processes.
# Only workers reorder; a run without -n keeps the files in their order.
IN_PROCESS_FIRST = 0.2  # the share of the in-process files not marked `waits` (by count) before the `measures` files


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):
        return
    starts_processes = {item.path for item in items if item.get_closest_marker("process")}
    solo = {item.path for item in items if item.get_closest_marker("solo")}
    measures = {item.path for item in items if item.get_closest_marker("measures")} - solo
    waits = {item.path for item in items if item.get_closest_marker("waits")} - starts_processes
    order = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    tests = Counter(item.path for item in items)
    steady = [path for path in order if path not in starts_processes and path not in waits]
    later = set(steady[round(len(steady) * IN_PROCESS_FIRST) :])  # run beside the `measures` files

    def rank(item):
        path = item.path
        if path in solo:
            group = (0, 0)
        elif path in waits:
            group = (1, -tests[path])
        elif path in measures:
            group = (2, 0)
        elif path not in starts_processes:
            group = (3, 0) if path in later else (1, 1)
        else:
            group = (4, 0)
        return group, order[path]

    items.sort(key=rank)  # stable: a file's tests keep their order
