"""Redraw the dashboard screenshots in this folder (SVG, Textual's own exporter).

    python docs/screenshots/make_screenshots.py                       # a real run: the README's first command
    python docs/screenshots/make_screenshots.py --at-step 30          # ... pictured live at step 30, then stopped
    python docs/screenshots/make_screenshots.py -- --max-steps 20     # ... with other `gptop train` flags
    python docs/screenshots/make_screenshots.py --replay RUN_DIR      # a finished run, replayed
    python docs/screenshots/make_screenshots.py --synthetic           # only the synthetic GPU pictures

* run-160x48.svg, run-80x24.svg: a real run on this machine. By default the README's first command,
  `gptop train --max-steps 200`, runs live in the real dashboard (Textual's headless pilot at 160x48; the
  same session, sampler and trainer as `gptop train`); when the run is done the screen is saved, then the
  terminal is resized to 80x24 and saved again. `--replay RUN_DIR` draws a finished run from its run
  directory instead (events.jsonl, device.jsonl, the trainer's logs).
* gpu-160x48.svg, gpu-80x24.svg, help-80x24.svg: the SYNTHETIC event stream of the tests
  (tests/fixtures/streams.py: a DeepSeek-style MoE on an H100 with the tuner at work). Its numbers are
  invented to exercise the GPU panels; no GPU ran it. It is the stream the snapshot tests draw.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gptop.controls import RecordingCommands  # noqa: E402
from gptop.state import RunState  # noqa: E402
from gptop.ui.app import GptopApp  # noqa: E402
from trainer.contract.events import DoneEvent, read_events  # noqa: E402

README_FIRST = ["--max-steps", "200"]


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


async def shot(state: RunState, size: tuple[int, int], name: str, out: Path, keys: tuple[str, ...] = ()) -> None:
    app = GptopApp(state, RecordingCommands())
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        for k in keys:
            await pilot.press(k)
            await pilot.pause()
        await pilot.pause(0.3)
        app.save_screenshot(filename=name, path=str(out))
    print(out / name)


async def live(train_argv: list[str], out: Path, at_step: int | None) -> int:
    """`gptop train TRAIN_ARGV` in the real dashboard until the run ends (or reaches `at_step`: the pictures
    are taken live, then the run is stopped as `q` stops it); the two screenshots."""
    from gptop import cli, preflight
    from gptop.session import Session, SessionOptions

    ns = cli.build_parser().parse_args(["train", *train_argv])
    cfg = preflight.resolve_config(ns)
    preflight.check_run_args(ns, cfg)
    session = Session(cfg, SessionOptions(interval=ns.interval))
    session.state.clock = time.time
    app = GptopApp(session.state, session)
    t0 = time.time()
    session.start()
    try:
        async with app.run_test(size=(160, 48)) as pilot:
            while not session.finished and (at_step is None or (session.state.step or 0) < at_step):
                await pilot.pause(0.5)
            await pilot.pause(1.0)  # the last events and the final redraw
            app.save_screenshot(filename="run-160x48.svg", path=str(out))
            await pilot.resize_terminal(80, 24)
            await pilot.pause(1.0)
            app.save_screenshot(filename="run-80x24.svg", path=str(out))
            if not session.finished:
                session.stop()  # what `q` does: a checkpoint, then the trainer exits
    finally:
        if not session.finished:
            session.stop(force=True)
        code = session.wait(120.0)
        session.close()
    print(f"gptop train {' '.join(train_argv)}: exit {code}, {time.time() - t0:.0f} s, run dir {cfg.run.run_dir}")
    print(out / "run-160x48.svg")
    print(out / "run-80x24.svg")
    return 0 if code in (0, 130) else 1


async def synthetic(out: Path) -> None:
    from fixtures.streams import build_state

    await shot(build_state("gpu"), (160, 48), "gpu-160x48.svg", out)
    await shot(build_state("gpu"), (80, 24), "gpu-80x24.svg", out)
    await shot(build_state("gpu"), (80, 24), "help-80x24.svg", out, keys=("question_mark",))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=HERE, help="folder for the SVGs (default: docs/screenshots)")
    ap.add_argument(
        "--replay", type=Path, metavar="RUN_DIR", default=None, help="draw this finished run instead of running one"
    )
    ap.add_argument("--synthetic", action="store_true", help="only the synthetic GPU pictures")
    ap.add_argument(
        "--at-step",
        type=int,
        default=None,
        metavar="N",
        help="take the live pictures at step N, then stop the run (default: at its end)",
    )
    ap.add_argument(
        "train_argv",
        nargs="*",
        metavar="-- GPTOP_TRAIN_FLAGS",
        help=f"flags of the live run (default: the README's first command: {' '.join(README_FIRST)})",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(synthetic(args.out))
    if args.synthetic:
        return 0
    if args.replay is not None:
        state = state_from_run(args.replay)
        asyncio.run(shot(state, (160, 48), "run-160x48.svg", args.out))
        asyncio.run(shot(state, (80, 24), "run-80x24.svg", args.out))
        return 0
    return asyncio.run(live(args.train_argv or README_FIRST, args.out, args.at_step))


if __name__ == "__main__":
    sys.exit(main())
