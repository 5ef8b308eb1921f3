"""The `s` key: a sample of the newest checkpoint in a panel, made without stopping the dashboard.

Pilot tests drive the app with a fake sampler (an awaitable the test releases); the slow test runs
`gptop.tool_runner.sample_newest` for real on a tiny run's checkpoint: a `python -m trainer.sample` process.
"""

from __future__ import annotations

import asyncio

import pytest
from textual.geometry import Region
from textual.widget import Widget

from helpers import train_in_process
from fixtures.streams import T0, build_state, ev
from fixtures.waiting import pause_until
from gptop.controls import RecordingCommands
from gptop.state import RunState
from gptop.tool_runner import SampleOutcome, sample_newest
from gptop.ui.app import GptopApp
from gptop.ui.sample_panel import SamplePanel
from trainer.contract.tools import SampleResult

SIZE = (160, 48)


def text(widget: Widget) -> str:
    w, h = widget.outer_size
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, w, h)))


def result(step: int = 40, completion: str = " = 1\nprint(x)") -> SampleResult:
    return SampleResult(
        source=f"runs/r/checkpoints/step-{step:08d}.pt",
        step=step,
        family="llama",
        objective="causal",
        prompt="",
        completion=completion,
        new_tokens=7,
        stopped="max_new_tokens",
        temperature=0.8,
        seed=1,
        seconds=0.4,
        load_seconds=3.0,
    )


class FakeSampler:
    """Records each call; answers when the test releases it (meanwhile the app must keep working)."""

    def __init__(self, outcome: SampleOutcome):
        self.outcome = outcome
        self.calls: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, run_dir: str) -> SampleOutcome:
        self.calls.append(run_dir)
        await self.release.wait()
        return self.outcome


@pytest.mark.slow
def test_s_shows_a_sample_while_the_dashboard_goes_on():
    state = build_state("gpu")
    sampler = FakeSampler(SampleOutcome(result(), None, 3.5))
    cmds = RecordingCommands()
    app = GptopApp(state, cmds, sampler=sampler)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            panel = app.query_one(SamplePanel)
            assert not panel.display  # hidden until asked for
            await pilot.press("s")
            await pilot.pause()
            assert panel.display and "sampling the newest checkpoint of runs/fixture-gpu" in text(panel)
            assert sampler.calls == ["runs/fixture-gpu"]
            # the sample is still being made: keys and events go on
            await pilot.press("s")  # one sample at a time
            await pilot.press("c")
            last = state.last_step.step
            state.apply(
                ev(
                    "step",
                    state.last_step.time - T0 + 1,
                    step=last + 10,
                    tokens=1,
                    loss=1.25,
                    lr=1e-4,
                    grad_norm=0.5,
                    step_ms=100.0,
                    phases_ms=None,
                    tokens_per_s=1000.0,
                    mfu=None,
                    mem_bytes=None,
                )
            )
            moved = lambda: f"{last + 10}" in text(app.query_one("#header")) + text(app.query_one("#training"))
            await pause_until(pilot, lambda: cmds.names == ["checkpoint"] and moved(), what="the key and the step")
            assert sampler.calls == ["runs/fixture-gpu"]
            sampler.release.set()
            await pause_until(pilot, lambda: "print(x)" in text(panel), what="the sample")
            shown = text(panel)
            assert "step 40" in shown and "T=0.8" in shown
            assert not app.sampling
            await pilot.press("escape")
            await pilot.pause()
            assert not panel.display
            sampler.release = asyncio.Event()
            await pilot.press("s")  # another one
            await pilot.pause()
            assert len(sampler.calls) == 2 and panel.display

    asyncio.run(go())


def test_a_sample_that_fails_says_why():
    sampler = FakeSampler(SampleOutcome(None, "runs/x has no checkpoint yet; wait for the first one", 0.1))
    sampler.release.set()
    app = GptopApp(build_state("cpu"), RecordingCommands(), sampler=sampler)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("s")
            await pause_until(pilot, lambda: "has no checkpoint yet" in text(app.query_one(SamplePanel)), what="why")

    asyncio.run(go())


def test_no_run_directory_no_sample():
    sampler = FakeSampler(SampleOutcome(None, "unused", 0.0))
    app = GptopApp(RunState(status="monitor"), RecordingCommands(), sampler=sampler)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("s")
            await pilot.pause()
            assert sampler.calls == [] and not app.query_one(SamplePanel).display

    asyncio.run(go())


def test_quitting_while_sampling_cancels_the_sample():
    cancelled = []

    async def slow(run_dir: str) -> SampleOutcome:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(run_dir)
            raise
        return SampleOutcome(None, "unreachable", 0.0)

    app = GptopApp(build_state("cpu", status="done"), RecordingCommands(), sampler=slow)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("s")
            await pilot.pause()
            await pilot.press("q")
            await pilot.pause()

    asyncio.run(go())
    assert cancelled == ["runs/fixture-cpu"]


# --- the real sampler ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
def test_sample_newest_runs_the_tool_on_the_newest_checkpoint(tmp_path):
    from trainer.train import EXIT_OK

    run_dir = tmp_path / "run"
    assert train_in_process(run_dir, "--max-steps", "3", "--checkpoint-every", "2")[0] == EXIT_OK

    async def both():
        return await asyncio.gather(
            sample_newest(run_dir, max_new_tokens=8, timeout=120), sample_newest(tmp_path / "empty", timeout=120)
        )

    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    got, empty = asyncio.run(both())
    assert got.error is None and got.result is not None, got.error
    assert got.result.step == 3 and got.result.source.endswith("step-00000003.pt")
    assert 0 <= got.result.new_tokens <= 8 and got.seconds > 0
    assert empty.result is None and "made no checkpoint" in empty.error
