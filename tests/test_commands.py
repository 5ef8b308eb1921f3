"""trainer.commands: the step-boundary agreement, here the log-interval command the tuner uses while it
measures the running process (one rank; the agreement over ranks is the same vector's MAX)."""

from __future__ import annotations

from trainer.commands import LOG_SHIFT, Commands


class FakeChannel:
    def __init__(self):
        self.pending, self.emitted = [], []

    def pending_commands(self):
        out, self.pending = self.pending, []
        return out

    def emit(self, type, **fields):
        self.emitted.append((type, fields))


def test_log_every_takes_effect_once_and_the_newest_request_wins():
    ch = FakeChannel()
    c = Commands(ch)
    assert c.poll().log_every is None
    ch.pending = [{"cmd": "log_every", "steps": 1, "seq": 100}]
    assert c.poll().log_every == 1
    assert c.poll().log_every is None  # acted on once
    ch.pending = [{"cmd": "log_every", "steps": 10, "seq": 102}, {"cmd": "log_every", "steps": 1, "seq": 101}]
    assert c.poll().log_every == 10  # the newest request, with its own interval
    ch.pending = [{"cmd": "log_every", "steps": 5, "seq": 99}]
    assert c.poll().log_every is None  # older than one acted on: a late duplicate
    assert not ch.emitted


def test_a_rank_that_saw_an_older_request_agrees_on_the_newest():
    """Two ranks: one has the restore (newer), the other still the first request. MAX keeps the newer
    request's own interval, even though it is the larger (or the smaller) number."""
    a, b = FakeChannel(), FakeChannel()
    vectors = {}

    def agree(rank):
        def f(values):
            vectors[rank] = values
            return values

        return f

    a.pending = [{"cmd": "log_every", "steps": 1, "seq": 200}]
    b.pending = [{"cmd": "log_every", "steps": 10, "seq": 150}]
    va = Commands(a, 0, agree(0))
    vb = Commands(b, 1, agree(1))
    va.poll()
    vb.poll()
    merged = [max(x, y) for x, y in zip(vectors[0], vectors[1])]
    decision = Commands(FakeChannel(), 0, lambda values: merged).poll()
    assert decision.log_every == 1 and merged[-1] // LOG_SHIFT == 200


def test_a_bad_log_every_command_is_ignored_with_a_warning():
    ch = FakeChannel()
    ch.pending = [{"cmd": "log_every", "steps": 0, "seq": 1}, {"cmd": "log_every", "steps": "x", "seq": 2}]
    assert Commands(ch).poll().log_every is None
    assert [t for t, _ in ch.emitted] == ["warning", "warning"]


def test_a_checkpoint_fault_is_agreed_like_a_command_and_acted_on_once():
    """`--fault checkpoint@N` (trainer/faults.py) joins the agreement as a request: a rank that has it makes
    every rank save, as a checkpoint command would."""
    seen = {}

    def agree(values):
        seen["v"] = values
        return values

    c = Commands(FakeChannel(), 0, agree)
    assert c.poll(checkpoint_fault=True).checkpoint and seen["v"][1] > 0
    with_fault = seen["v"]
    assert not c.poll().checkpoint
    other_rank = Commands(FakeChannel(), 1, lambda values: [max(x, y) for x, y in zip(values, with_fault)])
    assert other_rank.poll().checkpoint  # the rank without the fault saves too
