"""The profile screen (the `v` key): the newest profile window's summary (gptop.profile_text), or how to get
one."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from gptop.profile_text import profile_lines
from gptop.state import RunState


class ProfileScreen(ModalScreen[None]):
    """The newest profile window's summary (gptop.profile_text), or how to get one."""

    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("v", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def __init__(self, state: RunState) -> None:
        super().__init__()
        self.state = state

    def compose(self) -> ComposeResult:
        with self.state.lock:
            profile = self.state.profile
        if profile is None:
            body = Text("no profile yet: press p to trace the next 3 steps (or --profile-steps A-B)")
        else:
            body = Text("\n".join(profile_lines(profile, top=5)))
        with Vertical(id="help"):
            yield Static(Text("profile", style="bold underline"))
            yield Static(body)
            yield Static(Text("escape or v to close", style="grey62"), classes="gap")

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
