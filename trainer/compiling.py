"""`--compile`: the one place a model is handed to torch.compile, and gptop doctor's check of each mode.

`off` trains eagerly; `default`, `max-autotune-no-cudagraphs` compile with inductor; `reduce-overhead` and
`max-autotune` also capture CUDA graphs (CUDA only, and only without gradient accumulation:
trainer.contract.capabilities refuses the rest, so this module never sees it).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .contract.device import DeviceInfo
    from .contract.doctor import Outcome


def compile_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """`model` as `--compile mode` runs it (itself for off)."""
    if mode == "off":
        return model
    return torch.compile(model, mode=None if mode == "default" else mode)


def check(dev: "DeviceInfo", quick: bool, mode: str) -> "Outcome":
    """gptop doctor's `compile.<mode>` paths: train a small model a few steps eagerly and compiled with
    `mode` from the same start, the loop the trainer runs (forward, backward, AdamW, zero_grad to None):
    the losses agree within 1e-3 (relative), and the steps after the first do not recompile."""
    from .contract.capabilities import support
    from .contract.doctor import Outcome

    reason = support("compile", mode, dev, accumulation=1)
    if reason:
        return Outcome.skip(reason)
    device = dev.torch_device
    if dev.is_cuda:
        torch.cuda.set_device(device)
    steps = 5
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randn(16, 64, generator=g).to(device) for _ in range(steps)]

    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6

    def train(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run = compile_model(model, mode) if compiled else model
        losses = []
        for i, x in enumerate(batches):
            # after the first step (which compiles) a recompilation is an error, where torch can say so
            pinned = stance("fail_on_recompile") if compiled and i > 0 and stance is not None else None
            with pinned if pinned is not None else contextlib.nullcontext():
                loss = (run(x) - x).square().mean()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return [float(v) for v in losses]

    eager = train(False)
    torch.compiler.reset()
    try:
        compiled = train(True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return Outcome.verdict(False, f"{type(e).__name__}: {first}"[:300], f"torch.compile {mode} failed")
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager, compiled))
    finite = all(math.isfinite(v) for v in compiled)
    ok = finite and worst < 1e-3
    recompile = (
        "no recompilation after the first step" if stance is not None else "recompilation not checked (torch < 2.6)"
    )
    observed = (
        f"{steps} steps: worst relative loss difference {worst:.1e} (eager {eager[-1]:.5f}, compiled "
        f"{compiled[-1]:.5f}); {recompile}"
    )
    return Outcome.verdict(ok, observed, "the compiled steps disagree with eager", worst_relative_difference=worst)
