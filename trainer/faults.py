"""Test-only fault injection behind the hidden `--fault` flag (`--fault nan@12,oom@5`).

Each fault fires once per process at the start of the named step (0-based: the step that the step
event then reports as N+1). `KIND@STEP:RANK` fires on that rank only (`kill@5:1`); without `:RANK`,
on every rank. The kinds and where they strike:

    nan          the loss of the step's first micro-batch becomes NaN (so do its gradients)
    nan-grad     a gradient becomes NaN after backward while the loss stays finite
    nan-weights  a weight becomes NaN after the optimizer step (gradients and loss were finite)
    oom, crash, compile   the forward raises the matching error
    compile-cache  the forward fails as a half-written library of the shared inductor cache does: a file that
                   is not one is left in the cache and an ImportError names it (trainer.inductor_cache)
    kill         the process SIGKILLs itself in the forward
    stop         a graceful stop at the step boundary, as if a stop command had arrived
    checkpoint   a checkpoint at the step boundary, as if a checkpoint command had arrived

The boundary kinds (`stop`, `checkpoint`) act after the named number of steps is done: `stop@4` stops with
a checkpoint of step 4.
"""

from __future__ import annotations

import os

import torch

from .contract.config import ConfigError

KINDS = ("nan", "nan-grad", "nan-weights", "oom", "crash", "kill", "compile", "compile-cache", "stop", "checkpoint")


class Faults:
    def __init__(self, spec: str | None, rank: int = 0):
        self.at: dict[int, str] = {}
        for part in (spec or "").split(","):
            if not part:
                continue
            kind, _, where = part.partition("@")
            step, _, only = where.partition(":")
            if kind not in KINDS or not step.isdigit() or (only and not only.isdigit()):
                raise ConfigError("--fault", f"{part!r}: expected KIND@STEP[:RANK] with KIND in {', '.join(KINDS)}")
            if not only or int(only) == rank:
                if int(step) in self.at:
                    raise ConfigError(
                        "--fault", f"{part!r}: step {step} already has {self.at[int(step)]!r}; one fault per step"
                    )
                self.at[int(step)] = kind

    def take(self, step: int) -> str | None:
        """The fault of this step, consumed (a rolled-back step does not fire it again)."""
        return self.at.pop(step, None)

    def at_boundary(self, step: int, kind: str) -> bool:
        """Whether the boundary fault `kind` (`stop`, `checkpoint`) is due after `step` steps, consumed."""
        if self.at.get(step) != kind:
            return False
        del self.at[step]
        return True


def on_loss(kind: str | None, loss: torch.Tensor, step: int) -> torch.Tensor:
    """Strike in the forward pass; returns the loss (poisoned for `nan`)."""
    if kind == "nan":
        return loss * float("nan")
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} (--fault)")
    if kind == "crash":
        raise RuntimeError(f"injected crash at step {step} (--fault)")
    if kind == "kill":
        os.kill(os.getpid(), 9)
    if kind == "compile":
        from torch._dynamo.exc import BackendCompilerFailed

        raise BackendCompilerFailed(lambda *a: None, RuntimeError("injected compile error (--fault)"))
    if kind == "compile-cache":
        from .inductor_cache import ENV

        cache = os.environ.get(ENV) or os.path.join("/tmp", f"torchinductor_{os.getuid()}")
        path = os.path.join(cache, "zz", f"injected{step}.main.so")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * 16)  # what a killed linker leaves
        os.environ[ENV] = cache
        raise ImportError(f"{path}: invalid ELF header")
    return loss


def on_grads(kind: str | None, model: torch.nn.Module) -> None:
    if kind == "nan-grad":
        p = next(p for p in model.parameters() if p.grad is not None)
        p.grad.fill_(float("nan"))


def on_weights(kind: str | None, model: torch.nn.Module) -> None:
    if kind == "nan-weights":
        with torch.no_grad():
            next(iter(model.parameters())).fill_(float("nan"))
