"""torch.profiler over a window of steps: `--profile-steps A-B` or a `profile` command (the `p` key).

One Chrome trace per window, `profiles/steps-A-B.json` (`.rankN` for the other ranks), for Perfetto.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch


class StepProfiler:
    def __init__(self, out_dir: Path, rank: int, cuda: bool, window: tuple[int, int] | None,
                 on_written: Callable[[Path, int, int], None]):
        self.out_dir, self.rank, self.cuda = out_dir, rank, cuda
        self.window = window                      # the next window to profile (steps, inclusive)
        self.on_written = on_written
        self._prof: torch.profiler.profile | None = None
        self._span: tuple[int, int] | None = None

    def request(self, first: int, steps: int) -> None:
        self.window = (first, first + max(1, steps) - 1)

    def step_begin(self, step: int) -> None:
        w = self.window
        if w and step == w[0] and self._prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.start()
            self._span = w

    def step_end(self, step: int) -> None:
        if self._span is not None and step >= self._span[1]:
            self.close()

    def close(self) -> None:
        """Stop and write the trace of a window in progress (also when the run ends inside it)."""
        if self._prof is None or self._span is None:
            return
        prof, (a, b) = self._prof, self._span
        self._prof, self._span, self.window = None, None, None
        prof.stop()
        suffix = f".rank{self.rank}" if self.rank else ""
        out = self.out_dir / f"steps-{a}-{b}{suffix}.json"
        out.parent.mkdir(exist_ok=True)
        prof.export_chrome_trace(str(out))
        self.on_written(out, a, b)
