"""`Probe`: gptop's view into a plain PyTorch training loop.

    from gptop.integrations.torch import Probe

    probe = Probe(model, optimizer=opt, max_steps=max_iters)   # the model the loop calls, its optimizer(s)
    for iter_num in range(start, max_iters):
        probe.step(iter_num + 1)           # step iter_num + 1 begins here; the one before ends
        if probe.should_checkpoint or probe.should_stop:
            save(...); probe.checkpointed(path)      # the checkpoint of iter_num steps
        if probe.should_stop:
            break
        for micro_step in range(accumulation):
            loss = model(x, y); loss.backward()
        opt.step(); opt.zero_grad()
        probe.log(loss=loss)               # a tensor is read back only at log steps
    probe.close()

The breakdown comes from hooks on the model's forward and the optimizers' step (gptop.integrations.loop_hooks):
data until the step's first forward, forward (summed over micro-steps), backward from a forward's end to
the next forward or the optimizer's step, optimizer, and other for what the step's time leaves. The explicit
form still works, and an explicit phase wins over the hooks where it is given:

    with probe.step(step):
        with probe.phase("data"):      batch = next(it)
        with probe.phase("forward"):   loss = model(batch)
        with probe.phase("backward"):  loss.backward()
        with probe.phase("optimizer"): opt.step(); opt.zero_grad()
        probe.log(loss=loss)

Outside gptop (no GPTOP_CHANNEL in the environment) every call returns at once and no hook is installed:
`step` and `phase` hand back one shared null context, the flags stay False (bench/probe_overhead.py measures
the cost). Under `gptop run -- CMD` the first `step` connects to gptop (gptop.integrations.client.Client) and
from then on the probe reports as gptop's own trainer does. Before that first step gptop's stop reaches the
program as a signal would without gptop (Ctrl-C raises KeyboardInterrupt); from it on, SIGINT and SIGTERM
set `should_stop`.
"""

from __future__ import annotations

import atexit
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from trainer.contract.client import ClientEnv, ClientKind

from .client import TIMED, Client, Value, describe_model, model_precision, module_device
from .loop_hooks import LoopHooks, optimizers_of, unwrap

_NULL = nullcontext()
_PHASES = frozenset(TIMED)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # the MFU columns a program's own precision maps to


class _Step:
    """`with probe.step(n):` under gptop: the call began the step, leaving the block ends it (one object,
    reused every step)."""

    __slots__ = ("probe",)

    def __init__(self, probe: "Probe"):
        self.probe = probe

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.probe.end(failed=kind is not None)


class _Phase:
    """`with probe.phase(name):` under gptop: the timer's phase, with the hooks' phase paused while it runs."""

    __slots__ = ("client", "hooks", "name", "open")

    def __init__(self, client: Client, hooks: LoopHooks, name: str):
        self.client, self.hooks, self.name = client, hooks, name
        self.open: list[AbstractContextManager] = []

    def __enter__(self) -> None:
        self.hooks.pause()
        cm = self.client.phase(self.name)
        cm.__enter__()
        self.open.append(cm)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.open.pop().__exit__(kind, value, tb)
        self.hooks.resume(trained=self.name != "data")


@dataclass(frozen=True)
class _Options:
    """What the program told its Probe, kept until the first step connects."""

    tokens_per_step: int | None
    flops_per_token: float | None
    seq_len: int | None
    log_every: int | None
    max_steps: int | None
    precision: str | None


class Probe:
    """Reports a plain loop's steps to gptop; a no-op outside gptop. See the module docstring.

    `model`: the module the loop calls (its parameters give the hello's counts, the device and, without
    `flops_per_token`, the FLOPs per token; its forward hooks the forward and backward phases and the
    tokens): the torch.compile or DDP wrapper when the loop calls that. `optimizer`: one or several (a list);
    their step hooks give the optimizer phase, and the first's learning rate is reported when `log` gives
    none. `tokens_per_step`: the tokens this process trains on per step (several ranks: gptop counts each
    rank's; `step(n, tokens=...)` overrides it for a step); without it, the elements of the `input_ids` (or
    first tensor) of the step's training forwards. `seq_len`: adds the attention term to the counted FLOPs
    of a transformers model (without it, taken from the first forward's input). `log_every`: steps between
    step events (`gptop run --log-every` wins; default 10). `max_steps`: the progress bar's end.
    `precision`: fp32, tf32, bf16, fp16 (the MFU denominator; default: the autocast the model's first forward
    runs under, else its parameters' dtype)."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        tokens_per_step: int | None = None,
        flops_per_token: float | None = None,
        seq_len: int | None = None,
        optimizer: Any = None,
        log_every: int | None = None,
        max_steps: int | None = None,
        precision: str | None = None,
    ):
        for name, v in (
            ("tokens_per_step", tokens_per_step),
            ("seq_len", seq_len),
            ("log_every", log_every),
            ("max_steps", max_steps),
        ):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Probe({name}={v!r}): a whole number of at least 1, or None")
        if precision not in (None, *PRECISIONS):
            raise ValueError(f"Probe(precision={precision!r}): one of {', '.join(PRECISIONS)}, or None")
        self._env = ClientEnv.from_environ()
        self.active = self._env is not None  # under gptop
        self._model = model
        optimizers = optimizers_of(optimizer)
        self._optimizer = optimizers[0] if optimizers else None
        self._options = _Options(
            tokens_per_step=tokens_per_step,
            flops_per_token=flops_per_token,
            seq_len=seq_len,
            log_every=log_every,
            max_steps=max_steps,
            precision=precision,
        )
        self._client: Client | None = None
        self._step = _Step(self)
        self._tokens: int | None = None  # the current step's `step(n, tokens=...)`
        self._phases: dict[str, _Phase] = {}
        self._warned = False
        # Installed now, before a torch.compile of the model traces its first call; idle until the first step.
        self._hooks = LoopHooks(model if self.active else None, optimizers if self.active else [])

    # ------------------------------------------------------------------ the loop's calls
    def step(self, step: int, tokens: int | None = None) -> AbstractContextManager:
        """Optimizer step `step` (from 1; a resumed loop starts where it left off) begins: the step before it,
        if still open, ends here. As a plain call it marks the boundary, and the step lasts until the next
        call (or `checkpointed` after it trained, or `close`); as `with probe.step(n):` it ends with the block
        (an exception in it: the step is not reported)."""
        if not self.active:
            return _NULL
        self.begin(step, tokens)
        return self._step if self.active else _NULL

    def phase(self, name: str) -> AbstractContextManager:
        """The context of a phase of the step: data, forward, backward or optimizer (several of one kind in a
        step, as with gradient accumulation, add up). It wins over the hooks: while it runs they time
        nothing. Outside a step: nothing is timed."""
        if name not in _PHASES:
            raise ValueError(f"Probe.phase({name!r}): one of {', '.join(TIMED)}")
        client = self._client
        if client is None or not client.in_step:
            return _NULL
        return self._phases[name]

    def log(self, loss: Value | None = None, lr: Value | None = None, grad_norm: Value | None = None) -> None:
        """Values of this step. Tensors stay on the device: they are read back once per log interval."""
        if self._client is not None:
            self._client.log(loss=loss, lr=lr, grad_norm=grad_norm)

    @property
    def should_checkpoint(self) -> bool:
        """gptop asked for a checkpoint (the `c` key, a tuner, SIGUSR1): save, then call `checkpointed`."""
        return self._client is not None and self._client.should_checkpoint

    @property
    def should_stop(self) -> bool:
        """gptop asked the run to stop (q, Ctrl-C, SIGTERM, gptop gone): save, `checkpointed`, leave the loop.
        With several ranks it turns true on the same step everywhere."""
        return self._client is not None and self._client.should_stop

    def checkpointed(self, path: str | os.PathLike) -> None:
        """Tell gptop the loop wrote a checkpoint at `path` (any format): a checkpoint event of the steps done,
        whose duration is the save: from the last thing the probe saw the loop do (a step's end, an
        evaluation's last forward) to this call. A step begun by a plain `step` call that has not trained
        yet begins again after the save; one that has (a save after the loop's last step) ends before it is
        reported, with the save in its time."""
        client = self._client
        if client is None:
            return
        seconds = self._hooks.since_mark()
        if client.in_step:
            if self._hooks.trained:
                self.end()
            else:
                self._hooks.restart()
        client.checkpointed(path, seconds=seconds)
        self._hooks.touch()  # the next save's time starts after this one

    def close(self) -> None:
        """The training is over (also done at exit): a step still open is reported if it trained (else, as
        after a stop's `break`, not), the `done` event, the hooks removed, the connection closed."""
        client = self._client
        if client is not None and self.active:
            if client.in_step:
                self.end(failed=not self._hooks.trained or client.crashed)
            client.close()
        self._hooks.remove()
        self.active = False
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ under gptop
    def begin(self, number: int, tokens: int | None = None) -> None:
        client = self._client
        if client is None:
            client = self._client = self._connect(number)
            if client is None:  # gptop could not be reached: the probe is off from here
                self.active = False
                self._hooks.remove()
                return
        elif client.in_step:
            self.end()
        self._tokens = tokens
        client.begin_step(number)
        self._hooks.begin()

    def end(self, failed: bool = False) -> None:
        client = self._client
        if client is None or not client.in_step:
            return
        counted = self._hooks.finish()
        if failed:  # the step raised, or never trained: nothing to report (an error reaches gptop at exit)
            client.abandon_step()
            return
        tokens = self._tokens if self._tokens is not None or client.tokens_per_step else counted
        if tokens is not None:
            client.add_tokens(tokens)
        if not client.said_hello:
            self._hello(self._options.seq_len)
        self._check_forward(client)
        client.end_step()
        client.poll()  # first, as the trainer's step boundary: a new log interval counts now
        if client.is_log_step():
            client.flush()

    def _check_forward(self, client: Client) -> None:
        """An optimizer step without a forward of the hooked model: the loop calls another module (say once)."""
        hooks = self._hooks
        if self._warned or self._model is None or hooks.forwards or not hooks.stepped:
            return
        self._warned = True
        client.warn(
            f"the probe saw step {client.step}'s optimizer step but no training forward of its "
            f"{type(self._model).__name__}: no forward, backward or data times, nor tokens; give Probe the module "
            f"the loop calls (the torch.compile or DDP wrapper), or time them with probe.phase"
        )

    def _connect(self, first_step: int) -> Client | None:
        o = self._options
        model = unwrap(self._model) if self._model is not None else None
        device = module_device(model)
        client = Client.connect(
            self._env,
            ClientKind.PROBE,
            device=device,
            log_every=o.log_every,
            tokens_per_step=o.tokens_per_step,
            max_steps=o.max_steps,
            precision=o.precision or model_precision(model, device),
            optimizer=self._optimizer,
            reduce_loss=True,
            start_step=first_step - 1,
        )
        if client is None:
            return None
        self._hooks.attach(client)
        self._phases = {name: _Phase(client, self._hooks, name) for name in TIMED}
        if (o.seq_len is None or o.precision is None) and self._hooks.installed and self._model is not None:
            # the sequence length and the precision the model runs in (an autocast entered inside the step) are
            # known at its first forward
            self._hooks.on_forward = self._hello_at_forward
        else:
            self._hello(o.seq_len)
        atexit.register(self.close)  # after the client's: runs first, with the client still open
        return client

    def _hello_at_forward(self, ids: torch.Tensor | None) -> None:
        client, o = self._client, self._options
        if client is not None and o.precision is None and self._model is not None:
            model = unwrap(self._model)
            client.set_precision(model_precision(model, module_device(model)))
        seq_len = (
            o.seq_len if o.seq_len is not None else int(ids.shape[-1]) if ids is not None and ids.dim() >= 2 else None
        )
        self._hello(seq_len)

    def _hello(self, seq_len: int | None) -> None:
        client = self._client
        if client is None or client.said_hello:
            return
        model = unwrap(self._model) if self._model is not None else None
        client.hello(describe_model(model, seq_len=seq_len, flops_per_token=self._options.flops_per_token))
