"""The help screen (the `?` key): every key and what each panel shows; a monitor's own keys while it watches
a run it did not start."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from gptop.state import RunState
from trainer.contract.states import RunStatus

HELP = [
    (
        "q",
        "Quit: finish the step, checkpoint and stop the trainer, then exit (press again to stop at once, "
        "without a checkpoint)",
    ),
    ("c", "Checkpoint now (at the next step boundary)"),
    ("p", "Profile the next 3 steps with torch.profiler (trace in the run directory)"),
    (
        "v",
        "View the newest profile window's summary: per phase the top operators (and kernels on a GPU), "
        "launch-bound and GPU-idle shares",
    ),
    ("s", "Sample the newest checkpoint into a panel (its own process; training goes on; escape closes)"),
    ("l", "Log panel: zoom the trainer's stdout/stderr to the whole window, and back"),
    (
        "t",
        "Start the autotuner on the live run (budget 10 min; gptop tune --budget for another), or stop it, "
        "keeping the best setting found so far",
    ),
    ("r", "Restart from the last good checkpoint (after a failure)"),
    ("w", "Chart window of the device panel: 30 s, 1 min, 5 min, 15 min, 1 h"),
    ("e", "Next MoE layer in the expert-load bars"),
    ("?", "This help"),
    ("ctrl+p", "Command palette: every action by name"),
    ("ctrl+c", "As q: the first stops with a checkpoint, a second one at once (without a checkpoint)"),
]

# The keys of a monitor watching a run it did not start (RunState.observer): q only leaves, c reaches the trainer
# through its signal channel (SIGUSR1), and the keys that would act on the run otherwise (p, t, r) are not offered.
WATCHING_HELP = [
    ("q", "Leave the monitor: the watched run goes on (it was not started here; stop it where it runs)"),
    ("c", "Checkpoint now: asks the watched trainer (SIGUSR1) for a checkpoint at the next step boundary"),
    ("v", HELP[3][1]),
    ("s", HELP[4][1]),
    (
        "l",
        "Log panel: zoom the watched trainer's trainer.log and trainer.stderr.log (their tail, followed) to the "
        "whole window, and back",
    ),
    ("w", HELP[8][1]),
    ("e", HELP[9][1]),
    ("?", "This help"),
    ("ctrl+p", "Command palette: every action by name"),
    ("ctrl+c", "As q: leave the monitor; the run goes on"),
]

PANELS_HELP = [
    (
        "alerts",
        "a line under the header for each open alert (a stall, a loss spike, a NaN rollback, a throughput "
        "drop, GPU trouble), with the terminal bell when one is raised; gone once resolved",
    ),
    (
        "devices",
        "utilization, memory and power per GPU (or the CPU) with history charts; 'trainer N% of M "
        "cores' is the trainer's processes' share of the whole machine",
    ),
    (
        "step breakdown",
        "where a step's time goes: data, forward, backward, optimizer, other; GPU idle "
        "time; a hint about the bottleneck and the toggle to try",
    ),
    (
        "training",
        "loss (and eval loss), tokens/s, MFU, learning rate, gradient norm, memory, energy per "
        "token, expert load for MoE models",
    ),
    ("tuner", "the autotuner's phase, budget, trials and the best setting found"),
    ("log", "the trainer's stdout and stderr (stderr in red)"),
]


def offered_help(state: RunState | None, rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The help's key rows less the keys this run never offers (a user's program: `s`, and `t` unless gptop
    tunes it), as the footer leaves them out (GptopApp.check_action)."""
    if state is None:
        return rows
    hidden = {"s": not state.sample_offered, "t": not state.tuning_offered}
    return [(k, v) for k, v in rows if not hidden.get(k)]


class HelpScreen(ModalScreen[None]):
    """Every key and what each panel shows (a monitor's own keys while it watches a run: `watching`)."""

    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def __init__(self, state: RunState | None = None) -> None:
        super().__init__()
        self.state = state

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold cyan", no_wrap=True)
        keys.add_column()
        observer = self.state is not None and self.state.observer
        for k, v in offered_help(self.state, WATCHING_HELP if observer else HELP):
            keys.add_row(k, v)
        panels = Table.grid(padding=(0, 2))
        panels.add_column(style="bold", no_wrap=True)
        panels.add_column()
        for k, v in PANELS_HELP:
            panels.add_row(k, v)
        with Vertical(id="help"):
            if observer:
                yield Static(Text(watching_words(self.state), style="bold magenta"))  # type: ignore[arg-type]
            yield Static(Text("keys", style="bold underline"))
            yield Static(keys)
            yield Static(Text("panels", style="bold underline"), classes="gap")
            yield Static(panels)
            yield Static(Text("escape or ? to close", style="grey62"), classes="gap")

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)


def watching_words(state: RunState) -> str:
    """'watching pid 4242 (started elsewhere; q leaves, the run goes on)', or a replay's or an ended run's words."""
    if state.watching is not None:
        return f"watching pid {state.watching} (started elsewhere; q leaves, the run goes on)"
    if state.status is RunStatus.REPLAY:
        return "replaying a finished run (q leaves)"
    return "watching a run that has ended (q leaves)"
