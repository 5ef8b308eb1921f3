"""The optimizer: AdamW's weight-decay groups, the learning-rate schedule, and a step that a non-finite
step does not take.

Skipping a non-finite step costs no host synchronization with fused AdamW (the default): the flag stays
on the device and goes to the fused kernel as `found_inf`, the same protocol GradScaler uses, which
leaves parameters, moments and step counts untouched when it is set. The foreach kernel has no such
input, so there the flag is read on the host before the step: free on the CPU (its kernels run
synchronously), one synchronization per step on CUDA with `--no-fused-adamw`, the same price GradScaler
charges non-fused optimizers. With fp16 the GradScaler is already the gate: an overflowing gradient is
its routine signal to skip the step and lower the scale, not a failed step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .contract.config import TrainConfig

BETAS, EPS = (0.9, 0.95), 1e-8


def decays(name: str, param: torch.Tensor) -> bool:
    """The weight-decay rule: matrices decay; embeddings, norms and biases do not."""
    return param.ndim >= 2 and "embed" not in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups (decay, no decay); also what bench/peers.py gives its contenders."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def param_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in the optimizer's id order (how a one-file checkpoint's optimizer state is keyed)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, p in named if decays(n, p)] + [n for n, p in named if not decays(n, p)]


def adamw_flags(fused: bool) -> dict[str, Any]:
    """The kernel is a toggle of the run, not of a checkpoint: re-applied after every load."""
    return {"fused": True, "foreach": None} if fused else {"fused": None, "foreach": True}


def build_adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=lr_at(0, cfg), betas=BETAS, eps=EPS,
                             **adamw_flags(cfg.toggles.fused_adamw))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to min_lr_ratio * lr; a pure function of the step, so resume is exact."""
    o = cfg.optim
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, o.max_steps - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, finite: torch.Tensor) -> None:
    """One optimizer step, not taken when `finite` (a device bool) is False; see the module docstring."""
    if scaler.is_enabled():
        scaler.step(optimizer)          # its own inf check gates the step (fused: on the device)
    elif all(g.get("fused") for g in optimizer.param_groups):
        optimizer.found_inf = (~finite).float()          # read by the fused kernel, as GradScaler sets it
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif bool(finite):
        optimizer.step()
    scaler.update()
