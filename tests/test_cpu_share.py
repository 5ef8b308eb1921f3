"""tests/fixtures/cpu_share.py: the lock that keeps other workers' process tests away from a measuring test.

Two holders in one process stand for two pytest-xdist workers (flock locks belong to an open file, so two
holders conflict as two processes would)."""

from __future__ import annotations

import threading
import time

import pytest

from fixtures import cpu_share
from fixtures.cpu_share import EXCLUSIVE, SHARED

pytestmark = pytest.mark.waits  # on real time (the lock's waits): tests/conftest.py's order


@pytest.fixture
def lock_file(tmp_path, monkeypatch):
    path = tmp_path / "cpu.lock"
    path.touch()
    monkeypatch.setenv(cpu_share.ENV, str(path))
    return path


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_an_exclusive_holder_waits_for_a_shared_one_and_keeps_new_shared_ones_out(lock_file):
    a, b, c = cpu_share.Holder(), cpu_share.Holder(), cpu_share.Holder()
    a.set(SHARED)  # worker A runs a process test
    got = threading.Event()
    t = in_thread(lambda: (b.set(EXCLUSIVE), got.set()))  # worker B's measuring test waits for it
    assert not got.wait(0.3)
    a.set(0)
    assert got.wait(5) and b.mode == EXCLUSIVE
    t.join(5)
    shared = threading.Event()
    t = in_thread(lambda: (c.set(SHARED), shared.set()))  # a process test waits while B measures
    assert not shared.wait(0.3)
    b.set(0)
    assert shared.wait(5)
    t.join(5)
    c.set(0)


def test_a_waiting_exclusive_holder_is_not_starved_by_shared_ones_coming_and_going(lock_file):
    a, b, c = cpu_share.Holder(), cpu_share.Holder(), cpu_share.Holder()
    a.set(SHARED)
    got = threading.Event()
    t = in_thread(lambda: (b.set(EXCLUSIVE), got.set()))
    time.sleep(0.2)  # B waits at the turnstile's far side
    late = threading.Event()
    t2 = in_thread(lambda: (c.set(SHARED), late.set()))  # a new shared holder queues behind B
    assert not late.wait(0.3)
    a.set(0)
    assert got.wait(5) and not late.wait(0.3)
    b.set(0)
    assert late.wait(5)
    t.join(5)
    t2.join(5)
    c.set(0)


def test_quiet_then_steady_hold_to_the_tests_end_and_never_take_the_machine_back(lock_file, monkeypatch):
    """A process test that measures: `quiet()` while its tuner measures, `steady()` for the rest; it never waits to
    hold the machine shared again in between (the other worker's measuring test may have it), and the item's
    hold lets go of whatever it holds at its end, also when the test fails inside `quiet()`."""
    holder = cpu_share.Holder()
    monkeypatch.setattr(cpu_share, "THIS_PROCESS", holder)
    with cpu_share.hold(SHARED):  # a process test (tests/conftest.py)
        cpu_share.quiet()
        assert holder.mode == EXCLUSIVE
        cpu_share.steady()
        assert holder.mode == 0
    assert holder.mode == 0
    with pytest.raises(RuntimeError):
        with cpu_share.hold(SHARED):
            cpu_share.quiet()
            raise RuntimeError("the tuner never decided")
    assert holder.mode == 0


def test_without_the_variable_nothing_is_locked(monkeypatch):
    monkeypatch.delenv(cpu_share.ENV, raising=False)
    holder = cpu_share.Holder()
    holder.set(EXCLUSIVE)
    assert holder.mode == 0 and holder.fd is None


def test_a_wait_of_a_second_or_more_is_logged_with_the_test_that_waited(lock_file, tmp_path, monkeypatch):
    """GPTOP_TEST_CPU_WAITS: each wait names its test, also one in the item's hold before its setup began."""
    log = tmp_path / "waits"
    monkeypatch.setenv(cpu_share.WAIT_LOG_ENV, str(log))
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    a, b = cpu_share.Holder(), cpu_share.Holder()
    a.set(EXCLUSIVE)  # the other worker's measuring test
    t = in_thread(lambda: b.set(SHARED, "tests/test_x.py::test_y"))
    time.sleep(1.2)
    a.set(0)
    t.join(5)
    b.set(0)
    (line,) = log.read_text().splitlines()
    _, worker, mode, seconds, test = line.split(" ", 4)
    assert mode == "shared" and float(seconds) >= 1.0 and test == "tests/test_x.py::test_y"
