"""`Probe`: gptop's view into a plain PyTorch training loop.

    from gptop.integrations.torch import Probe

    probe = Probe(model, tokens_per_step=batch * seq_len)     # flops_per_token=None: counted from the model
    for step in range(start + 1, max_steps + 1):
        with probe.step(step):
            with probe.phase("data"):      batch = next(it)
            with probe.phase("forward"):   loss = model(batch)
            with probe.phase("backward"):  loss.backward()
            with probe.phase("optimizer"): opt.step(); opt.zero_grad()
            probe.log(loss=loss)           # a tensor is read back only at log steps
        if probe.should_checkpoint or probe.should_stop:
            save(...); probe.checkpointed(path)
        if probe.should_stop:
            break

Outside gptop (no GPTOP_CHANNEL in the environment) every call returns at once: `step` and `phase` hand back
one shared null context, the flags stay False (bench/probe_overhead.py measures the cost). Under
`gptop run -- CMD` the first `step` connects to gptop (gptop.integrations.client.Client) and from then on the
probe reports as gptop's own trainer does. Before that first step gptop's stop reaches the program as a signal
would without gptop (Ctrl-C raises KeyboardInterrupt); from it on, SIGINT and SIGTERM set `should_stop`.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from trainer.contract.client import ClientEnv, ClientKind

from .client import TIMED, Client, Value, describe_model, model_precision, module_device
from .precision import PrecisionWatch

_NULL = nullcontext()
_PHASES = frozenset(TIMED)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # the MFU columns a program's own precision maps to


class _Step:
    """The context of one step under gptop (one object, reused every step)."""

    __slots__ = ("probe", "number", "tokens")

    def __init__(self, probe: "Probe"):
        self.probe = probe
        self.number = 0
        self.tokens: int | None = None

    def __enter__(self) -> None:
        self.probe.begin(self.number)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.probe.end(self.tokens, failed=kind is not None)


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

    `model`: the module that trains (its parameters give the hello's counts, the device and, without
    `flops_per_token`, the FLOPs per token). `tokens_per_step`: the tokens this process trains on per step
    (several ranks: gptop counts each rank's; `step(n, tokens=...)` overrides it for a step). `seq_len`: adds
    the attention term to the counted FLOPs of a transformers model. `optimizer`: its learning rate is
    reported when `log` gives none. `log_every`: steps between step events (`gptop run --log-every` wins;
    default 10). `max_steps`: the progress bar's end. `precision`: fp32, tf32, bf16, fp16 (the MFU
    denominator; default: the autocast the model's first forward runs under, else its parameters' dtype)."""

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
        self._model, self._optimizer = model, optimizer
        self._options = _Options(
            tokens_per_step=tokens_per_step,
            flops_per_token=flops_per_token,
            seq_len=seq_len,
            log_every=log_every,
            max_steps=max_steps,
            precision=precision,
        )
        self._client: Client | None = None
        self._watch: PrecisionWatch | None = None
        self._step = _Step(self)

    # ------------------------------------------------------------------ the loop's calls
    def step(self, step: int, tokens: int | None = None) -> AbstractContextManager:
        """The context of optimizer step `step` (from 1; a resumed loop starts where it left off)."""
        if not self.active:
            return _NULL
        self._step.number, self._step.tokens = step, tokens
        return self._step

    def phase(self, name: str) -> AbstractContextManager:
        """The context of a phase of the step: data, forward, backward or optimizer (several of one kind in a
        step, as with gradient accumulation, add up). Outside a step: nothing is timed."""
        if name not in _PHASES:
            raise ValueError(f"Probe.phase({name!r}): one of {', '.join(TIMED)}")
        client = self._client
        if client is None or not client.in_step:
            return _NULL
        return client.phase(name)

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
        """Tell gptop the loop wrote a checkpoint at `path` (any format): a checkpoint event."""
        if self._client is not None:
            self._client.checkpointed(path, seconds=self._client.since_step_end())

    def close(self) -> None:
        """The training is over (also done at exit): the `done` event, the connection closed."""
        if self._watch is not None:
            self._watch.close()
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------ under gptop
    def begin(self, number: int) -> None:
        if self._client is None:
            self._client = self._connect(number)
            if self._client is None:  # gptop could not be reached: the probe is off from here
                self.active = False
                return
        self._client.begin_step(number)

    def end(self, tokens: int | None, failed: bool) -> None:
        client = self._client
        if client is None:
            return
        self._hello(client, None)  # the model did not run in the first step: the precision read at connect
        if failed:  # the step raised: nothing to report; the error reaches gptop at exit
            client.abandon_step()
            return
        if tokens is not None:
            client.add_tokens(tokens)
        client.end_step()
        client.poll()  # first, as the trainer's step boundary: a new log interval counts now
        if client.is_log_step():
            client.flush()

    def _connect(self, first_step: int) -> Client | None:
        o = self._options
        model, device = self._model, module_device(self._model)
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
        if client is not None and o.precision is None and model is not None:
            # the precision the model runs in (an autocast entered inside the step) is known at its first forward
            self._watch = PrecisionWatch(model, device, lambda precision: self._hello(client, precision))
        elif client is not None:
            self._hello(client, None)
        return client

    def _hello(self, client: Client, precision: str | None) -> None:
        if client.said_hello:
            return
        if precision is not None:
            client.set_precision(precision)
        o = self._options
        client.hello(describe_model(self._model, seq_len=o.seq_len, flops_per_token=o.flops_per_token))
