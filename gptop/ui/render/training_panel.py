"""The training panel: the loss chart and the numbers that matter; expert load for MoE models."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from gptop.state import RunState, fmt_bytes, fmt_mfu, fmt_num

from .breakdown_panel import no_figures
from .drawing import Rows, level_bars, spark_rows


def training(state: RunState, width: int, height: int, expert_layer: int) -> RenderableType:
    """Loss chart and the numbers that matter: loss, eval, tokens/s, MFU, lr, grad norm, memory, J/token;
    expert load for MoE models."""
    with state.lock:
        last = state.last_step
        loss = state.history("loss")
        eval_loss = state.series["eval_loss"].last
    if last is None:
        return Text(no_figures(state), style="grey62")
    w = state.window()  # tokens/s and MFU: the breakdown's steps and statistic (the subtitle says)
    moe = state.expert_imbalance() is not None
    numbers: list[Text] = []
    lv = last.loss
    numbers.append(
        Text.assemble(
            ("loss ", "bold"),
            ("n/a" if lv is None else f"{lv:.3f}", "bold green"),
            "  eval ",
            "n/a" if eval_loss is None else f"{eval_loss:.3f}",
            "  grad ",
            "n/a" if last.grad_norm is None else f"{last.grad_norm:.2f}",
            "  lr ",
            "n/a" if last.lr is None else f"{last.lr:.2e}",
        )
    )
    mfu = w.mfu if w is not None else last.mfu
    tps = w.tokens_per_s if w is not None else last.tokens_per_s
    jpt = state.joules_per_token()
    numbers.append(
        Text.assemble(
            (fmt_num(tps), "bold cyan"),
            " tok/s",
            "  MFU ",
            fmt_mfu(mfu, state.mfu_is_estimate),
            "  mem ",
            fmt_bytes(last.mem_bytes),
            "" if last.optim_state_bytes is None else f" (optimizer {fmt_bytes(last.optim_state_bytes)})",
            "  energy ",
            "n/a" if jpt is None else f"{jpt * 1000:.2f} mJ/tok",
        )
    )
    expert_lines: list[Text] = []
    if moe:
        mx, mean = state.expert_imbalance()  # type: ignore[misc]
        n_layers = len(state.expert_load or [])
        layer = expert_layer % max(1, n_layers)
        loads = state.expert_layer(layer)
        expert_lines.append(
            Text.assemble(
                ("experts ", "bold"), f"max/ideal {mx:.2f}× (mean {mean:.2f}×)", f" · layer {layer + 1}/{n_layers}"
            )
        )
        each = max(1, min(4, (width - 2) // max(1, len(loads))))
        expert_lines.append(level_bars(loads, each=each, style="cyan"))
    for t in numbers + expert_lines:
        t.truncate(width, overflow="ellipsis")
    room = height - len(numbers) - len(expert_lines) - 1
    lines: list[RenderableType] = []
    if room >= 1 and loss:
        label = Text(f"loss {min(loss):.3f}–{max(loss):.3f} · last {len(loss)} logs", style="grey62")
        label.truncate(width, overflow="ellipsis")
        lines.append(label)
        rates = state.history("tokens_per_s")
        rows = room - 3 if room >= 8 and rates else room
        lines.append(Rows(spark_rows(loss, width, "dark_green", "green1", height=rows, stretch=True)))
        if room >= 8 and rates:
            lines.append(
                Text(f"tokens/s {fmt_num(min(rates))}–{fmt_num(max(rates))} · last {len(rates)} logs", style="grey62")
            )
            lines.append(Rows(spark_rows(rates, width, "dark_cyan", "cyan1", height=2, stretch=True)))
    return Group(*lines, *numbers, *expert_lines)
