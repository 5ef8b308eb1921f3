"""Regenerate the dashboard screenshots in this folder (SVG, from Textual's own exporter).

    python docs/screenshots/make_screenshots.py [RUN_DIR]

* gpu-160x48.svg, gpu-80x24.svg, help-80x24.svg: the recorded fixture stream of tests/fixtures
  (a DeepSeek-style MoE on an H100, the tuner at work): no GPU is needed to draw it, and it is the
  same stream the snapshot tests use.
* run-160x48.svg, run-80x24.svg: a real run, replayed from its run directory (events.jsonl, the
  device samples gptop wrote to device.jsonl, the trainer's log files), e.g. one made with
  `gptop train --model llama --size tiny --seq-len 64 --global-batch 8 --max-steps 300 --run-dir /tmp/ui1`.
  Skipped without RUN_DIR.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fixtures.streams import build_state  # noqa: E402
from gptop.commands import RecordingCommands  # noqa: E402
from gptop.state import RunState  # noqa: E402
from gptop.ui.app import GptopApp  # noqa: E402
from trainer.contract.events import DoneEvent, read_events  # noqa: E402


def state_from_run(run_dir: Path) -> RunState:
    """A finished run as the dashboard showed it at its end: its events and device samples in time
    order, then its log lines."""
    events = []
    for name in ("events.jsonl", "device.jsonl"):
        path = run_dir / name
        if path.exists():
            events += read_events(path)
    events.sort(key=lambda e: e.time)
    state = RunState(run_dir=str(run_dir), status="running")
    for e in events:
        state.apply(e)
    for stream, name in (("stdout", "trainer.log"), ("stderr", "trainer.stderr.log")):
        path = run_dir / name
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                state.add_log(line, stream)
    if any(isinstance(e, DoneEvent) for e in events):
        state.set_status("done")
    return state


async def shot(state: RunState, size: tuple[int, int], name: str, keys: tuple[str, ...] = ()) -> None:
    app = GptopApp(state, RecordingCommands())
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        for k in keys:
            await pilot.press(k)
            await pilot.pause()
        await pilot.pause(0.3)
        app.save_screenshot(filename=name, path=str(HERE))
    print(HERE / name)


async def main(run_dir: Path | None) -> None:
    await shot(build_state("gpu"), (160, 48), "gpu-160x48.svg")
    await shot(build_state("gpu"), (80, 24), "gpu-80x24.svg")
    await shot(build_state("gpu"), (80, 24), "help-80x24.svg", keys=("question_mark",))
    if run_dir is not None:
        await shot(state_from_run(run_dir), (160, 48), "run-160x48.svg")
        await shot(state_from_run(run_dir), (80, 24), "run-80x24.svg")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
