"""Non-finite steps: the flags each step leaves on the device, and the NaN policy that acts on them.

A step whose loss or gradient norm is not finite leaves a device int8 flag (no synchronization); the
flags of an interval are read back at once (`check`) before a state is used: on a log step, before an
eval and before a checkpoint. A raised `NonFiniteStep` goes to the NaN policy (`roll_back`): back to the
newest checkpoint that verifies (or the initialization), the poisoning batch skipped from then on and the
learning rate scaled down; or, by --nan-policy stop or after --nan-retries rollbacks, an error.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

import torch

from . import checkpoint_files as ckpt_files
from . import dist as D
from .checkpointer import Checkpointer, Progress
from .contract.config import RunConfig
from .contract.states import ErrorKind, WarningKind

# The bits of a step's non-finite flag (device int8): what went non-finite.
LOSS, GRAD = 1, 2
WHAT = {LOSS: "loss", GRAD: "gradient norm", LOSS | GRAD: "loss and gradient norm"}


class NonFiniteStep(RuntimeError):
    """A step whose loss, gradient norm or resulting state is not finite: the NaN policy applies."""

    def __init__(self, step: int, batch_index: int, what: str = "loss"):
        super().__init__(f"non-finite {what} at step {step} (batch {batch_index})")
        self.step, self.batch_index = step, batch_index


def step_flags(loss: torch.Tensor, grad_norm: torch.Tensor, *, scaled: bool) -> torch.Tensor:
    """A step's flag on the device: LOSS | GRAD bits. With a loss scaler (fp16) a non-finite gradient is the
    scaler's signal to skip the step, not a failure."""
    bad = (~torch.isfinite(loss)).to(torch.int8) * LOSS
    if not scaled:
        bad = bad + (~torch.isfinite(grad_norm)).to(torch.int8) * GRAD
    return bad


class NonFiniteGuard:
    """The interval's flags and the NaN policy of one run. `emit0` and `log` report; `fail(kind, message)`
    ends the run with an error (it does not return)."""

    def __init__(
        self,
        run: RunConfig,
        *,
        group: D.Group | None,
        emit0: Callable[..., None],
        log: Callable[[str], None],
        fail: Callable[..., NoReturn],
    ):
        self.run, self.group, self.emit0, self.log, self.fail = run, group, emit0, log, fail
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (step, batch index, device flag)

    def record(self, step: int, batch_index: int, flags: torch.Tensor) -> None:
        self.pending.append((step, batch_index, flags))

    def check(self) -> None:
        """Read back the interval's non-finite flags (one sync); raise before a poisoned state is used."""
        if not self.pending:
            return
        stacked = torch.stack([b for _, _, b in self.pending]).to(torch.int32)
        if self.group is not None:  # a non-finite step on any rank rolls every rank back
            self.group.max_(stacked)
        flags = stacked.cpu().tolist()
        for (step, bi, _), bad in zip(self.pending, flags):
            if bad:
                raise NonFiniteStep(step, bi, WHAT.get(bad, "loss"))
        self.pending = []

    def roll_back(
        self,
        e: NonFiniteStep,
        progress: Progress,
        ckpt: Checkpointer,
        *,
        resumed_from: str | None,
        reinitialize: Callable[[], Any],
    ) -> Progress:
        """The progress to go on from after `e`: the newest checkpoint of this run that verifies, restored by
        `ckpt`, or the initialization (`reinitialize()` rebuilds the model and optimizer), with the batch
        skipped and the learning rate scaled. Fails the run when the policy says stop."""
        run, p = self.run, progress
        self.emit0("warning", message=str(e), step=e.step, batch=e.batch_index)
        if run.nan_policy == "stop" or p.nan_rollbacks >= run.nan_retries:
            why = "--nan-policy stop" if run.nan_policy == "stop" else f"{p.nan_rollbacks} rollbacks already"
            self.fail(ErrorKind.NAN, f"{e}; giving up ({why}). Try a lower --lr or another --precision.")
        skips = sorted(set(p.skip_batches) | {e.batch_index})
        rollbacks, scale = p.nan_rollbacks + 1, p.lr_scale * run.nan_lr_factor
        had_checkpoint = ckpt.newest is not None
        restored = ckpt.rollback(p.step)
        if restored is not None:
            path, p = restored
            source = path.name
        elif resumed_from is not None:  # this process cannot rebuild what came before the resume
            raise ckpt_files.CorruptCheckpoint(
                f"no checkpoint of this run verifies any more (it resumed from "
                f"{resumed_from}; see the warnings above), nothing to roll back to"
            )
        else:
            reinitialize()
            p = Progress()
            source = f"initialization ({'no checkpoint verifies' if had_checkpoint else 'no checkpoint yet'})"
        p.skip_batches, p.nan_rollbacks, p.lr_scale = skips, rollbacks, scale
        msg = (
            f"rolled back to {source} at step {p.step}; skipping batch {e.batch_index}; "
            f"learning rate x{scale:g} (rollback {rollbacks}/{run.nan_retries})"
        )
        self.emit0(
            "warning", message=msg, kind=WarningKind.NAN_ROLLBACK, step=p.step, skip_batches=skips, lr_scale=scale
        )
        self.log(msg)
        self.pending = []
        return p
