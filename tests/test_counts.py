"""Steps and tokens across a run's processes (gptop.state.counts): every reader (the state behind the dashboard,
the summary and the metrics; `gptop report`'s streaming pass) continues the run's count across a restart, a
rollback, a resume and a client whose count starts again at 0, and tells kept tokens from processed ones."""

from __future__ import annotations

import pytest

from fixtures.streams import T0, ev, gpu_device, restarted_run
from gptop.metrics import RunCollector
from gptop.report import format_report, summarize
from gptop.state import RunState
from gptop.summary import summary_lines
from trainer.contract.events import HelloEvent, StepEvent, dumps
from trainer.contract.states import WarningKind

TPS = 1024  # restarted_run's tokens per step
# How each process counts its tokens: gptop's trainer restores the run's count; a transformers client restores its
# step but counts from 0; a probe given tokens_per_step counts from start_step x tokens_per_step. `said`: the
# hello says start_tokens (False: an older producer, before the field).
COUNTINGS = {
    "trainer": dict(),
    "trainer-older-hello": dict(said=False),
    "client-from-0": dict(client="transformers"),
    "client-older-hello": dict(client="transformers", said=False),
    "probe-with-tokens-per-step": dict(client="probe", knows_tokens=True),
}
# the first process to 40 (a tuner's switch there), the second to 75 (a failed trial), the third from the
# checkpoint at 60 to 100: steps 61-75 were trained and thrown away
RESTARTS = [(0, 40), (40, 75), (60, 100)]


def fed(events) -> RunState:
    state = RunState(run_dir="runs/restarted", status="running")
    for e in events:
        state.apply(e)
    return state


def write(run_dir, events, devices=()) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(dumps(e) + "\n" for e in events))
    if devices:
        (run_dir / "device.jsonl").write_text("".join(dumps(e) + "\n" for e in devices))


@pytest.mark.parametrize("counting", COUNTINGS.values(), ids=COUNTINGS)
def test_the_state_continues_the_count_over_restarts_and_leaves_rolled_back_steps_out(counting):
    state = RunState()
    for e in restarted_run(RESTARTS, **counting):
        state.apply(e)
        if isinstance(e, StepEvent):  # at every step: the kept steps' tokens, whatever the process counted
            assert state.tokens == e.step * TPS, e
        if isinstance(e, HelloEvent) and e.start_step == 60 and not e.early:  # the header: where the run went back to
            assert (state.step, state.tokens, state.counts.rolled_back_steps) == (60, 60 * TPS, 15)
    c = state.counts
    assert (state.step, c.step, c.processes) == (100, 100, 3)
    assert (c.rolled_back_steps, c.rolled_back_tokens, c.processed) == (15, 15 * TPS, 115 * TPS)
    assert c.processed_steps == 115


@pytest.mark.parametrize("counting", COUNTINGS.values(), ids=COUNTINGS)
def test_a_resumed_process_seen_alone_counts_from_its_start_step(counting):
    """`gptop train --resume`, or a monitor that attaches to a later process: the run's count before it is
    the process's restored one, else its start step at the rate it trains at."""
    state = fed(restarted_run([(60, 100)], **counting))
    assert (state.step, state.tokens, state.counts.rolled_back_steps) == (100, 100 * TPS, 0)


def test_a_nan_rollback_inside_the_trainer_counts_its_steps_as_rolled_back():
    events = restarted_run([(0, 50)])
    done = events.pop()  # the trainer goes on after the rollback: no end yet
    nan = ev("warning", done.time, kind=WarningKind.NAN_ROLLBACK.value, message="rolled back", step=40)
    more = [e for e in restarted_run([(0, 60)], t0=done.time) if isinstance(e, StepEvent) and e.step > 40]
    state = fed([*events, nan, *more])
    c = state.counts
    assert (state.step, state.tokens, c.rolled_back_steps, c.processed) == (60, 60 * TPS, 10, 70 * TPS)


def test_the_eta_is_from_the_step_the_run_reached():
    events = [e for e in restarted_run(RESTARTS, client="transformers") if e.type != "done"]
    state = fed(events)
    eta = state.eta()  # 100 of 200 steps left at 0.5 s a step
    assert eta is not None and eta == pytest.approx(100 * 0.5, abs=1.0)


@pytest.mark.parametrize("counting", COUNTINGS.values(), ids=COUNTINGS)
def test_the_summary_says_kept_and_processed_tokens(counting, tmp_path):
    state = fed(restarted_run(RESTARTS, **counting))
    state.set_status("stopped")
    (progress,) = [line for line in summary_lines(state, 130) if line.strip().startswith("progress")]
    assert progress.endswith("100/200 steps, 102.4k tokens kept, 117.8k processed incl. 15 rolled-back steps")
    plain = fed(restarted_run([(0, 40), (40, 100)], **counting))  # a restart without a rollback: one figure
    plain.set_status("stopped")
    assert any(line.endswith("100/200 steps, 102.4k tokens") for line in summary_lines(plain, 130))


@pytest.mark.parametrize("counting", COUNTINGS.values(), ids=COUNTINGS)
def test_the_metrics_export_kept_and_processed_tokens(counting):
    collector = RunCollector("node-a")
    collector.state = fed(restarted_run(RESTARTS, **counting))
    got = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert got["gptop_step"] == 100 and got["gptop_tokens"] == 100 * TPS
    assert got["gptop_tokens_processed_total"] == 115 * TPS


@pytest.mark.parametrize("counting", COUNTINGS.values(), ids=COUNTINGS)
def test_the_report_counts_across_restarts_and_its_energy_is_per_token_processed(counting, tmp_path):
    events = restarted_run(RESTARTS, **counting)
    steps = [e for e in events if isinstance(e, StepEvent)]
    t0, t1 = steps[0].time - T0, steps[-1].time - T0
    devices = [gpu_device(float(t), 0.5) for t in range(int(t0) - 1, int(t1) + 2)]  # 450 W, as its counter says
    write(tmp_path, events, devices)
    s = summarize(tmp_path)
    assert (s["steps"], s["tokens"], s["tokens_processed"]) == (100, 100 * TPS, 115 * TPS)
    assert (s["steps_rolled_back"], s["tokens_rolled_back"], s["starts"]) == (15, 15 * TPS, 3)
    # the joules of the whole span, restarts included, over the tokens processed in it (from the first step event)
    assert s["energy_j"] == pytest.approx(450.0 * (t1 - t0), rel=1e-6)
    assert s["energy_j_per_token"] == pytest.approx(s["energy_j"] / ((115 - steps[0].step) * TPS))
    text = format_report(s)
    assert "progress  100/200 steps, 102,400 tokens kept, 117,760 processed incl. 15 rolled-back steps, 3 start(s)" in (
        text
    )
    assert " mJ/token processed (NVML energy counter)" in text


def test_the_report_of_a_resumed_client_counts_from_its_start_step(tmp_path):
    write(tmp_path, restarted_run([(60, 100)], client="lightning"))
    s = summarize(tmp_path)
    assert (s["steps"], s["tokens"], s["tokens_processed"], s["steps_rolled_back"]) == (100, 100 * TPS, 100 * TPS, 0)


def test_a_second_node_hello_is_not_a_restart():
    """Each node's first rank says hello: the run's first hello's rank starts processes, the others' do not."""
    events = restarted_run([(0, 40)])
    other = ev(
        "hello",
        events[1].time + 0.5,
        rank=4,
        **{k: getattr(events[1], k) for k in ("config", "model")},
        device=events[1].device.to_dict(),
        pid=999,
        start_step=0,
        start_tokens=0,
    )
    state = fed([*events[:2], other, *events[2:]])
    assert (state.tokens, state.counts.processes) == (40 * TPS, 1)
