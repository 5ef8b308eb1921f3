"""A plain loop's step breakdown from hooks on its model and optimizers, for `gptop.integrations.torch.Probe`.

`LoopHooks` places the time of a step the Probe began (`Probe.step`) in phases, from what it sees:

- a training forward of the model (in training mode, gradients on): `forward`, from its forward pre-hook to
  its forward hook, summed over gradient accumulation's micro-steps; its input's tokens are counted;
- from the end of a forward to the next forward or an optimizer's step: `backward` (gradient clipping and
  a GradScaler's unscale included, as the transformers callback counts them);
- an optimizer's step (`Optimizer.register_step_pre_hook` -> `register_step_post_hook`), each optimizer's:
  `optimizer`; what follows it (zero_grad, the scheduler, logging) is `other`;
- what comes before the step's first forward: `data`.

A step whose optimizer did not run (a GradScaler skipped it: inf or NaN gradients) has no optimizer time;
its backward lasts to the step's end. A forward that is not a training forward (an evaluation: `model.eval()`
or `torch.no_grad()`) is no part of the step: before the step's first training forward the step begins
again once it returns (the evaluation was not the next step's data wait), after it its time is `other`.
An explicit phase (`Probe.phase`) wins: while one is open the hooks time nothing.

The phases go through the client's timer (`Client.enter`/`leave`: CUDA events on a GPU, host clocks on the
CPU), so the hooks add no synchronization. On a GPU the forward hook fires when the forward's kernels are
queued; the events recorded there place the phases on the GPU's timeline all the same.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Protocol

import torch

# The wrappers whose `module` is the module they train (torch.compile's is `_orig_mod`).
WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


class PhaseSink(Protocol):
    """What the hooks drive: the client's open phases of the current step (gptop.integrations.client.Client)."""

    in_step: bool

    def enter(self, name: str) -> None: ...
    def leave(self, name: str) -> None: ...
    def restart_step(self) -> None: ...


def token_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The batch a model is called with: `input_ids`, else `inputs_embeds` (batch x sequence x hidden), else
    the first positional tensor; its elements are the tokens."""
    for key in ("input_ids", "inputs_embeds"):
        v = kwargs.get(key)
        if isinstance(v, torch.Tensor):
            return v if key == "input_ids" else v[..., 0]
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a wrapper trains: inside torch.compile's, DDP's, DataParallel's and FSDP's wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ in WRAPPERS:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def optimizers_of(optimizer: Any) -> list[Any]:
    """`optimizer` as a list: None, one optimizer, or several (a list or tuple)."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


class LoopHooks:
    """The phases of the current step from the model's forward and the optimizers' step (module docstring).

    `sink`: the client, from its first step on (`attach`); until then the hooks do nothing. `on_forward`:
    called with the first training forward's token ids (the probe's hello learns the sequence length there).
    `clock`: the host clock of `mark`, the time the loop was last seen at work (a checkpoint's save began
    after it)."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizers: Iterable[Any],
        *,
        clock: Callable[[], float] | None = None,
    ):
        self.sink: PhaseSink | None = None
        self.on_forward: Callable[[torch.Tensor | None], None] | None = None
        self.clock = clock or time.perf_counter
        self.cursor: str | None = None  # the phase the loop is in, by the hooks
        self.paused = 0  # explicit phases and evaluation forwards open: the hooks time nothing
        self.trained = False  # the step ran a training forward, an optimizer step or an explicit phase
        self.forwards = 0  # training forwards in the step
        self.stepped = False  # an optimizer stepped in the step
        self.tokens = 0  # their tokens
        self.mark = self.clock()
        self._handles: list[Any] = []
        if model is not None:
            # torch.compile traces hooks on a module it compiles: disabled for it, they run as plain Python
            self._handles += [
                model.register_forward_pre_hook(torch.compiler.disable(self._forward_begins), with_kwargs=True),
                model.register_forward_hook(torch.compiler.disable(self._forward_ends)),
            ]
        for opt in optimizers:
            self._handles += [
                opt.register_step_pre_hook(self._optimizer_begins),
                opt.register_step_post_hook(self._optimizer_ends),
            ]

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def attach(self, sink: PhaseSink) -> None:
        self.sink = sink

    def remove(self) -> None:
        """The hooks off the model and the optimizers (a compiled module may still call them: they do nothing)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.sink = None

    # ------------------------------------------------------------------ the step, from the probe
    def begin(self) -> None:
        """A step began (the sink's `begin_step`): its data wait is open until its first forward."""
        self.cursor, self.paused, self.trained, self.stepped, self.forwards, self.tokens = None, 0, False, False, 0, 0
        self._switch("data")

    def restart(self) -> None:
        """What ran since the step began was no part of it (an evaluation, a save): the step begins again."""
        sink = self.sink
        if sink is None or not sink.in_step:
            return
        sink.restart_step()  # closes the open phase and starts the step's clock again
        self.cursor = None
        self._switch("data")
        self.mark = self.clock()

    def finish(self) -> int:
        """The step ends (reported or abandoned): the open phase closed; the tokens its forwards counted."""
        self._switch(None)
        self.paused = 0
        self.mark = self.clock()
        return self.tokens

    def since_mark(self) -> float:
        return self.clock() - self.mark

    def touch(self) -> None:
        """The loop is at work now (what follows, say a save, starts here)."""
        self.mark = self.clock()

    def pause(self) -> None:
        """An explicit phase opens: the hooks' phase closes until it ends."""
        self.paused += 1
        if self.paused == 1 and self.cursor is not None and self.sink is not None:
            self.sink.leave(self.cursor)

    def resume(self, trained: bool = False) -> None:
        self.paused = max(0, self.paused - 1)
        self.trained = self.trained or trained
        self.mark = self.clock()
        if self.paused == 0 and self.cursor is not None and self.sink is not None:
            self.sink.enter(self.cursor)

    def _switch(self, name: str | None) -> None:
        """The loop moved on to phase `name` (None: other)."""
        if name == self.cursor:
            return
        sink = self.sink
        if self.paused == 0 and sink is not None:
            if self.cursor is not None:
                sink.leave(self.cursor)
            if name is not None:
                sink.enter(name)
        self.cursor = name

    # ------------------------------------------------------------------ the hooks
    def _live(self) -> bool:
        return self.sink is not None and self.sink.in_step

    def _forward_begins(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._live():
            return
        if not (module.training and torch.is_grad_enabled()):
            self.pause()  # an evaluation: no part of the step's forward
            return
        ids = token_ids(args, kwargs)
        if self.on_forward is not None:
            first, self.on_forward = self.on_forward, None
            first(ids)
        if ids is not None:
            self.tokens += ids.numel()
        self.trained = True
        self.forwards += 1
        self._switch("forward")

    def _forward_ends(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._live():
            return
        if not (module.training and torch.is_grad_enabled()):
            self.resume()
            if not self.trained and self.paused == 0:
                self.restart()
            return
        self._switch("backward")
        self.mark = self.clock()

    def _optimizer_begins(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._live():
            self.trained = self.stepped = True
            self._switch("optimizer")

    def _optimizer_ends(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._live():
            self._switch(None)
            self.mark = self.clock()
