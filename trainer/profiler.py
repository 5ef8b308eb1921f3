"""torch.profiler over a window of steps: `--profile-steps A-B` or a `profile` command (the `p` key).

One Chrome trace per window, `profiles/steps-A-B.json` (`.rankN` for the other ranks), for Perfetto
(ui.perfetto.dev) or chrome://tracing. Steps are numbered from 1, as the dashboard and the step events
number them: step N is the N-th optimizer step. The trace carries a `record_function` range per step,
`ProfilerStep#N` (the name torch.profiler's own schedule gives a step, so tools that split a trace by step
find them), and inside it one range per timed phase (`data`, `forward`, `backward`, `optimizer`; several
of each with gradient accumulation), opened by the step timer only while a window is being recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .timing import StepTimer

STEP_RANGE = "ProfilerStep#{}"


class StepProfiler:
    def __init__(
        self,
        out_dir: Path,
        rank: int,
        cuda: bool,
        window: tuple[int, int] | None,
        on_written: Callable[[Path, int, int, dict[str, Any] | None], None],
    ):
        self.out_dir, self.rank, self.cuda = out_dir, rank, cuda
        self.window = window  # the next window to profile (step numbers from 1, inclusive)
        self.on_written = on_written
        self._prof: torch.profiler.profile | None = None
        self._span: tuple[int, int] | None = None
        self._step_range: torch.profiler.record_function | None = None
        self._timer: StepTimer | None = None  # the step timer whose phases open ranges while recording
        self._last: int | None = None  # the window's last finished step (a run may end inside it)

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def request(self, first: int, steps: int) -> None:
        """Profile `steps` steps from step number `first` (a `profile` command: the next step)."""
        self.window = (first, first + max(1, steps) - 1)

    def step_begin(self, number: int, timer: StepTimer | None = None) -> None:
        """Step `number` (from 1) starts. A window that began before a resumed run's first step starts here."""
        w = self.window
        if w and w[0] <= number <= w[1] and self._prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.start()
            self._span, self._last = (number, w[1]), None
        if self._prof is not None:
            self._step_range = torch.profiler.record_function(STEP_RANGE.format(number))
            self._step_range.__enter__()
            if timer is not None:
                self._timer = timer
                timer.annotate = torch.profiler.record_function

    def step_end(self, number: int) -> None:
        self._end_step_range()
        if self._prof is not None:
            self._last = number
        if self._span is not None and number >= self._span[1]:
            self.close()

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def close(self) -> None:
        """Stop and write the trace of a window in progress (also when the run ends inside it)."""
        if self._prof is None or self._span is None:
            return
        self._end_step_range()
        if self._timer is not None:
            self._timer.annotate = None  # back to timing without ranges: no cost outside a window
            self._timer = None
        prof, (a, _) = self._prof, self._span
        b = self._last if self._last is not None else a
        self._prof, self._span, self.window = None, None, None
        prof.stop()
        suffix = f".rank{self.rank}" if self.rank else ""
        out = self.out_dir / f"steps-{a}-{b}{suffix}.json"
        out.parent.mkdir(exist_ok=True)
        prof.export_chrome_trace(str(out))
        summary = self._summary(prof, out)
        self.on_written(out, a, b, summary)

    @staticmethod
    def _summary(prof: torch.profiler.profile, trace: Path) -> dict[str, Any] | None:
        """The window summarized from the profiler's own events (bounded by the window, not the trace file),
        and written next to the trace; None when it cannot be (never fails the run)."""
        from .contract.atomic import atomic_write
        from .contract.events import to_dict
        from .profile_summary import spans_from_profiler, summarize

        try:
            summary = summarize(spans_from_profiler(prof.events()))
        except Exception as e:  # a profiler event this torch shapes differently
            print(f"[trainer] profile summary failed: {type(e).__name__}: {e}", flush=True)
            return None
        if summary is None:
            return None
        path = trace.with_name(trace.name.replace(".json", ".summary.json"))
        try:
            atomic_write(
                path, json.dumps({**summary, "phases": [to_dict(ph) for ph in summary["phases"]]}, indent=1) + "\n"
            )
            summary["summary_path"] = str(path)
        except OSError:
            pass
        return summary


def report_written(channel: Any, path: Path, first: int, last: int, summary: dict[str, Any] | None) -> None:
    """Tell gptop a window was written: a log line naming the trace and, when it could be summarized, the
    `profile` event. The trainer and gptop.integrations' clients both report through here."""
    channel.emit("log", message=f"profiler trace of steps {first}-{last} written to {path}", path=str(path))
    if summary is not None:
        channel.emit(
            "profile",
            first=first,
            last=last,
            path=str(path),
            summary_path=summary.get("summary_path"),
            step_ms=summary["step_ms"],
            phases=summary["phases"],
            short_op_share=summary.get("short_op_share"),
            short_kernel_share=summary.get("short_kernel_share"),
            gpu_idle_share=summary.get("gpu_idle_share"),
            gpu_idle_host_share=summary.get("gpu_idle_host_share"),
            comm_overlap=summary.get("comm_overlap"),
        )
