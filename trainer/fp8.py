"""float8 training through torchao: swap eligible Linear layers for Float8Linear.

`--precision fp8-tensorwise` / `fp8-rowwise` map to torchao's recipes of the
same names (``Float8LinearConfig.from_recipe_name``). Only Linear layers are
converted; attention, norms, routed MoE experts (3-D parameters) and the output
head stay in the high-precision dtype, so the rest of the model should run under
bf16 autocast (the rowwise recipe needs bf16 activations). torchao recommends
torch.compile with float8: it fuses the scaling and casting kernels.

Which layers: `module_filter` is a pure function, tested on the CPU. The output
head ``lm_head`` is skipped (its precision matters most for the loss, as in
torchtitan), and so is any Linear whose in or out features are not multiples of
16 (the fp8 GEMM's shape requirement).

`convert` needs an fp8-capable GPU (compute capability 8.9+); it asks
trainer.contract.capabilities first and raises ConfigError otherwise, so it is never run
on the CPU.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .contract.capabilities import support
from .contract.config import ConfigError
from .contract.device import DeviceInfo

if TYPE_CHECKING:
    from .contract.doctor import Outcome

RECIPES = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}
SKIP_NAMES = ("lm_head",)


def module_filter(module: torch.nn.Module, fqn: str) -> bool:
    """True if the Linear at `fqn` should become Float8Linear."""
    if not isinstance(module, torch.nn.Linear):
        return False
    if any(part in SKIP_NAMES for part in fqn.split(".")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def eligible(model: torch.nn.Module) -> list[str]:
    """Names of the Linear layers `convert` would swap (pure, runs anywhere)."""
    return [name for name, m in model.named_modules() if module_filter(m, name)]


def convert(model: torch.nn.Module, precision: str, dev: DeviceInfo) -> int:
    """Convert `model` in place for float8 training; returns the number of converted layers."""
    if precision not in RECIPES:
        raise ValueError(f"{precision!r} is not an fp8 precision ({', '.join(RECIPES)})")
    reason = support("precision", precision, dev)
    if reason:
        raise ConfigError("--precision", f"{precision} is not supported on {dev.name}: {reason}")
    return _convert(model, RECIPES[precision])


def convert_to_fp8(model: torch.nn.Module, recipe: str, dev: DeviceInfo | None = None) -> int:
    """`convert` by recipe name ("tensorwise" | "rowwise") for a model already on its device.

    Without `dev` the model's own device is the gate: parameters on anything
    but CUDA are refused (capability checks are the caller's, as in
    trainer.contract.capabilities.check).
    """
    if recipe not in RECIPES.values():
        raise ValueError(f"{recipe!r} is not an fp8 recipe ({', '.join(RECIPES.values())})")
    if dev is not None:
        return convert(model, f"fp8-{recipe}", dev)
    where = {p.device.type for p in model.parameters()}
    if where != {"cuda"}:
        raise ConfigError(
            "--precision",
            f"fp8-{recipe} needs the model on a CUDA GPU (it is on {', '.join(sorted(where)) or 'no device'})",
        )
    return _convert(model, recipe)


def _convert(model: torch.nn.Module, recipe: str) -> int:
    from .models import quiet_imports

    with quiet_imports():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    n = len(eligible(model))
    convert_to_float8_training(
        model, module_filter_fn=module_filter, config=Float8LinearConfig.from_recipe_name(recipe)
    )
    return n


def check(dev: DeviceInfo, quick: bool, recipe: str) -> "Outcome":
    """gptop doctor's `fp8.<recipe>` paths: `convert` a small model (what `--precision fp8-<recipe>` does to
    the built model) and take one training step under bf16 autocast: the eligible layers are Float8Linear,
    the loss is finite and the weights change."""
    from .contract.doctor import Outcome

    precision = f"fp8-{recipe}"
    reason = support("precision", precision, dev)
    if reason:
        return Outcome.skip(reason)
    device = dev.torch_device
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(device)
    converted = convert(model, precision, dev)
    kinds = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(torch.randn(64, 256, device=device)).float().square().mean()
    loss.backward()
    opt.step()
    value = float(loss.detach())
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    ok = converted == 2 and kinds == ["Float8Linear"] and math.isfinite(value) and moved
    return Outcome.verdict(
        ok,
        f"{converted} layers as {', '.join(kinds)}; loss {value:.4g}; weights {'changed' if moved else 'unchanged'}",
        f"the {recipe} fp8 step did not train",
        loss=value,
    )
