"""The sample panel (the `s` key): text from the newest checkpoint, under the other panels.

It only renders: the sample is made by `gptop.tool_runner.sample_newest` (which checkpoint, the command,
the time limit, the parsing), run by the app as a Textual worker so the dashboard never waits.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from gptop.tool_runner import SampleOutcome


class SamplePanel(Static):
    """Hidden until the first sample; then shows the newest one (or why there is none)."""

    DEFAULT_CSS = """
    SamplePanel {
        height: auto;
        max-height: 12;
        border: round $accent;
        border-title-color: $accent;
        padding: 0 1;
        display: none;
    }
    SamplePanel.-shown {
        display: block;
    }
    """

    def on_mount(self) -> None:
        self.border_title = "sample"
        self.border_subtitle = "s: another · escape: close"

    def show_running(self, run_dir: str | None) -> None:
        self.add_class("-shown")
        self.border_title = "sample"
        self.update(
            Text(
                f"sampling the newest checkpoint of {run_dir or 'this run'} in a process of its own "
                "(training goes on)…",
                style="grey62",
            )
        )

    def show_outcome(self, outcome: SampleOutcome) -> None:
        self.add_class("-shown")
        r = outcome.result
        if r is None:
            self.border_title = "sample"
            self.update(Text(outcome.error or "no sample", style="red"))
            return
        where = f"step {r.step}" if r.step is not None else r.source
        stopped = {
            "eos": "end of text",
            "max_new_tokens": f"{r.new_tokens} tokens",
            "timeout": f"time limit, {r.new_tokens} tokens",
        }.get(r.stopped, r.stopped)
        self.border_title = f"sample · {where} · T={r.temperature:g} · {stopped} · {r.seconds:.1f} s"
        body = Text()
        body.append(r.prompt, style="bold")
        body.append(r.completion or "(nothing generated)")
        self.update(Group(body))

    def close(self) -> None:
        self.remove_class("-shown")

    @property
    def shown(self) -> bool:
        return self.has_class("-shown")
