"""Training objectives: next-token prediction and LLaDA masked diffusion.

Both return a scalar loss tensor on the model's device and never read it back
(no ``.item()``, no boolean indexing): the trainer reads the loss only on log
steps, so a step never waits for the GPU here.

LLaDA (Nie et al., 2025, "Large Language Diffusion Models", Eq. 3 and the
reference ``forward_process``): for each sequence draw ``t ~ U(eps, 1)``, mask
every token independently with probability ``t`` (replace it by the mask id),
let the bidirectional model predict the original tokens from the masked
sequence, and take

    loss = sum over masked tokens of CE(logits, x_original) / t  /  (batch * seq_len)

The masking randomness comes only from the `generator` passed in (a CPU
generator: the same draws on every device, and its state is a few bytes to
checkpoint), so a resumed run masks exactly as the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

LLADA_EPS = 1e-3  # t ~ U(eps, 1): never divide by a t near zero (LLaDA's reference value)
IGNORE_INDEX = -100


def causal_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits for `x` against the next tokens `y` (-100 ignored)."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX)


def llada_mask(
    x: torch.Tensor, mask_id: int, generator: torch.Generator | None, eps: float = LLADA_EPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLaDA's forward process: (masked input, mask, per-token mask probability t).

    Random numbers are drawn on the CPU from `generator` and then moved to the
    batch's device, so the masks do not depend on the device or its RNG.
    """
    b, n = x.shape
    t = eps + (1 - eps) * torch.rand(b, 1, generator=generator)
    masked = torch.rand(b, n, generator=generator) < t
    masked = masked.to(x.device, non_blocking=True)
    t = t.to(x.device, non_blocking=True)
    return x.masked_fill(masked, mask_id), masked, t.expand(b, n)


def llada_loss(
    model: torch.nn.Module, x: torch.Tensor, *, mask_id: int, generator: torch.Generator | None
) -> torch.Tensor:
    """LLaDA masked-diffusion loss of a batch of clean sequences `x`."""
    noisy, masked, t = llada_mask(x, mask_id, generator)
    logits = model(input_ids=noisy).logits
    ce = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten(), reduction="none").view_as(t)
    return (ce * masked / t).sum() / x.numel()


def loss_fn(
    bundle_or_objective: Any,
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor | None,
    *,
    generator: torch.Generator | None = None,
    mask_id: int | None = None,
) -> torch.Tensor:
    """The training loss of one micro-batch.

    `bundle_or_objective` is a trainer.models.ModelBundle or an objective name
    ("causal" | "llada"). `y` is the next-token targets for "causal" and unused
    for "llada" (it predicts `x` itself). `mask_id` defaults to the bundle's.
    `generator` drives llada's masking; pass the run's CPU generator (and for
    validation a generator seeded the same way each time, so that successive
    validation losses see the same masks and are comparable).
    """
    objective = bundle_or_objective if isinstance(bundle_or_objective, str) else bundle_or_objective.objective
    if objective == "causal":
        if y is None:
            raise ValueError("the causal objective needs targets y")
        return causal_loss(model, x, y)
    if objective == "llada":
        if mask_id is None:
            mask_id = getattr(bundle_or_objective, "mask_id", None)
        if mask_id is None:
            raise ValueError("the llada objective needs a mask_id")
        return llada_loss(model, x, mask_id=mask_id, generator=generator)
    raise ValueError(f"unknown objective {objective!r}; expected 'causal' or 'llada'")
