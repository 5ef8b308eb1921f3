"""The optimizer: AdamW's weight-decay groups, the learning-rate schedule, and a step that a non-finite
step does not take.

`--optimizer` picks what holds the moments (all take the same two weight-decay groups, so decay is the
same rule): `adamw` (torch, fp32 moments: 8 bytes per trained parameter), `adamw-8bit` / `adamw-4bit`
(torchao.optim.AdamW8bit / AdamW4bit: block-wise quantized moments, about 2 / 1 bytes per parameter;
tensors under 4096 values keep fp32 moments; the update is compiled with torch.compile, hence the gate in
trainer.contract.capabilities), and `adafactor` (torch.optim.Adafactor: a factored second moment, one row
and one column vector per matrix, no first moment; its learning rate is relative, capped by 1/sqrt(step)
and scaled by the parameter's RMS, see the torch documentation). `state_bytes` is what the moments
really occupy (quantized tensors count their codes and scales), reported in step events.

The optimizer is a toggle (the tuner may trade it for memory), so a run may resume from a checkpoint of
another one: `convert_state` carries the AdamW variants' moments over (dequantized to fp32, then stored as
the new optimizer stores them); Adafactor's state converts to nothing and starts fresh
(trainer.contract.capabilities.optimizer_switch).

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


def kernel_flags(cfg: TrainConfig) -> dict[str, Any]:
    """The per-run kernel flags of the optimizer's groups (AdamW's fused/foreach; none for the others)."""
    return adamw_flags(cfg.toggles.fused_adamw) if cfg.toggles.optimizer == "adamw" else {}


def step_count_device(group: dict[str, Any], param: torch.Tensor) -> torch.device:
    """Where torch's AdamW expects a parameter's step count: on the parameter's device for the fused and
    capturable kernels, on the CPU for the others (a device step count there is read back per parameter per
    step: one synchronization each on CUDA)."""
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def place_step_counts(optimizer: torch.optim.Optimizer) -> int:
    """Put torch AdamW's step counts where this run's kernel expects them (`step_count_device`), after a load:
    torch's load_state_dict places them by the *saved* groups' flags, and the kernel is a toggle of this run
    (a checkpoint of fused AdamW resumed with --no-fused-adamw left them on the GPU). Returns how many moved."""
    if not isinstance(optimizer, torch.optim.AdamW):
        return 0
    moved = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if step is None or not hasattr(step, "device"):
                continue
            want = step_count_device(group, p)
            if step.device != want:
                dtype = torch.float32 if want.type != "cpu" else step.dtype
                optimizer.state[p]["step"] = step.to(device=want, dtype=dtype)
                moved += 1
    return moved


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The run's optimizer (`--optimizer`) over the parameters that train."""
    groups, lr, name = param_groups(model, cfg.optim.weight_decay), lr_at(0, cfg), cfg.toggles.optimizer
    groups = [g for g in groups if g["params"]] or groups[:1]  # LoRA: the adapters are all matrices
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, **adamw_flags(cfg.toggles.fused_adamw))
    if name in ("adamw-8bit", "adamw-4bit"):
        from .models import quiet_imports

        with quiet_imports():
            from torchao.optim import AdamW4bit, AdamW8bit
        cls = AdamW8bit if name == "adamw-8bit" else AdamW4bit
        return cls(groups, lr=lr, betas=BETAS, eps=EPS)
    if name == "adafactor":
        return torch.optim.Adafactor(groups, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer state occupies: a quantized tensor (torchao) counts its inner codes and scales."""

    def size(t: torch.Tensor) -> int:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()  # a DTensor (FSDP) also names its DeviceMesh: tensors only
            return sum(size(x) for x in (getattr(t, n) for n in names) if isinstance(x, torch.Tensor))
        return t.numel() * t.element_size()

    return sum(
        size(v) for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)
    )


def pending_state_bytes(optimizer: torch.optim.Optimizer, name: str) -> int:
    """Bytes optimizer `name` will still allocate for its state at its next step: all of it before the first
    step (AdamW creates its moments there), nothing once it has stepped or a checkpoint filled it. Counted
    by trainer.contract.estimate's rule over this rank's tensors (FSDP2: its shards), so a memory probe
    that runs forward and backward only can add what the first optimizer step will hold on to."""
    from .contract.estimate import optimizer_state_bytes
    from .contract.model_shapes import Tensor

    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    missing = [Tensor(tuple(p.shape)) for p, q in zip(local, params) if not optimizer.state.get(q)]
    return optimizer_state_bytes(name, missing) if missing else 0


def dense(t: torch.Tensor) -> torch.Tensor:
    """A moment as a plain fp32 tensor: torchao's quantized state (OptimState8bit/4bit) dequantized."""
    if type(t) is not torch.Tensor and hasattr(t, "dequantize"):
        t = t.dequantize()
    return t.detach().float()


def _stored(value: torch.Tensor, param: torch.Tensor, name: str, signed: bool, block_size: int | None) -> torch.Tensor:
    """`value` (fp32) stored the way optimizer `name` allocates a moment of `param`: torchao's rule (quantize
    only tensors of 4096+ values that are a multiple of the block, torchao/optim/adam.py), else fp32."""
    value = value.to(param.device, torch.float32).reshape(param.shape)
    n = param.numel()
    if name in ("adamw-8bit", "adamw-4bit") and block_size and n >= 4096 and n % block_size == 0:
        if name == "adamw-8bit":
            from torchao.optim.subclass_8bit import OptimState8bit as Quantized
        else:
            from torchao.optim.subclass_4bit import OptimState4bit as Quantized
        out = Quantized.zeros(param.shape, signed, block_size, device=param.device)
        out.copy_(value)  # torchao's copy_ quantizes block-wise
        return out
    return value.clone()


def convert_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], old: str, new: str) -> bool:
    """Load `saved` (the state_dict of an `old` optimizer over the same parameters) into `optimizer` (a `new`
    one): the AdamW variants' step counts and moments carry over, dequantized and stored as `new` stores
    them; the run's own hyperparameters stay `optimizer`'s. False (state left fresh) where nothing converts
    (Adafactor; trainer.contract.capabilities.optimizer_switch says why)."""
    from .contract.capabilities import optimizer_state_carries

    if not optimizer_state_carries(old, new):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    block = getattr(optimizer, "block_size", None)  # torchao's optimizers: their quantization block
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, s in saved["state"].items():
        p = params[int(i)]
        # the step count as a fresh optimizer keeps it: a host scalar (load_state_dict moves it to the
        # parameter's device where the kernel wants it there: fused or capturable AdamW)
        state[int(i)] = {
            "step": s["step"].detach().float().reshape(()).cpu().clone(),
            "exp_avg": _stored(dense(s["exp_avg"]), p, new, True, block),
            "exp_avg_sq": _stored(dense(s["exp_avg_sq"]), p, new, False, block),
        }
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return True


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to min_lr_ratio * lr; a pure function of the step, so resume is exact."""
    o = cfg.optim
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, o.max_steps - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """torchao's optimizers hold the rate as a tensor (their compiled step reads it), updated in place."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, finite: torch.Tensor) -> None:
    """One optimizer step, not taken when `finite` (a device bool) is False; see the module docstring."""
    if scaler.is_enabled():
        scaler.step(optimizer)  # its own inf check gates the step (fused: on the device)
    elif all(g.get("fused") for g in optimizer.param_groups):
        optimizer.found_inf = (~finite).float()  # read by the fused kernel, as GradScaler sets it
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif bool(finite):
        optimizer.step()
    scaler.update()


def check_grad_scaler(dev: Any, quick: bool, *, device: Any = None) -> Any:
    """gptop doctor's `fp16` path: steps under fp16 autocast through `step` with a GradScaler, as the loop
    takes them: a normal step changes the weights; a step whose gradient overflows is skipped (weights and
    moments untouched) and the scale halves."""
    from .contract.capabilities import support
    from .contract.doctor import Outcome

    reason = support("precision", "fp16", dev)
    if reason and device is None:
        return Outcome.skip(reason)
    device = torch.device(device) if device is not None else dev.torch_device  # tests: the CPU's fp16 autocast
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw_flags(True))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12)

    def train_step(overflow: bool) -> None:
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(torch.randn(16, 64, device=device)).float().square().mean()
        scaler.scale(loss).backward()
        if overflow:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        step(opt, scaler, finite=torch.ones((), dtype=torch.bool, device=device))
        opt.zero_grad(set_to_none=True)

    before = [p.detach().clone() for p in model.parameters()]
    train_step(False)
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    kept = [p.detach().clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    scale = scaler.get_scale()
    train_step(True)
    untouched = all(torch.equal(a, p) for a, p in zip(kept, model.parameters())) and all(
        torch.equal(m, s["exp_avg"]) for m, s in zip(moments, opt.state.values())
    )
    dropped = scaler.get_scale() == scale * 0.5
    ok = moved and untouched and dropped
    observed = (
        f"normal step {'changed' if moved else 'did not change'} the weights; overflowing step "
        f"{'skipped' if untouched else 'APPLIED'}; scale {scale:g} -> {scaler.get_scale():g}"
    )
    return Outcome.verdict(ok, observed, "GradScaler did not skip the overflow or lower its scale")


def check_fused_adamw(dev: Any, quick: bool) -> Any:
    """gptop doctor's `fused_adamw` path: fused AdamW's updates equal foreach AdamW's on this device, and a
    step flagged non-finite on the device (`step`'s found_inf protocol, no host read) changes nothing."""
    from .contract.doctor import Outcome

    device = dev.torch_device
    if dev.is_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    base = torch.nn.Linear(128, 64).to(device)
    models = {k: torch.nn.Linear(128, 64).to(device) for k in ("fused", "foreach")}
    for m in models.values():
        m.load_state_dict(base.state_dict())
    opts = {
        k: torch.optim.AdamW(
            m.parameters(), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.1, **adamw_flags(k == "fused")
        )
        for k, m in models.items()
    }
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    ones = torch.ones((), dtype=torch.bool, device=device)
    try:
        for _ in range(3):
            x = torch.randn(32, 128, device=device)
            for k, m in models.items():
                m(x).square().mean().backward()
                step(opts[k], scaler, finite=ones)
                opts[k].zero_grad(set_to_none=True)
    except (RuntimeError, NotImplementedError) as e:
        return Outcome.verdict(False, f"fused AdamW failed: {str(e).splitlines()[0]}", "fused AdamW does not run here")
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(models["fused"].parameters(), models["foreach"].parameters())
    )
    m = models["fused"]
    kept = [p.detach().clone() for p in m.parameters()]
    m(torch.randn(32, 128, device=device)).square().mean().backward()
    step(opts["fused"], scaler, finite=~ones)
    skipped = all(torch.equal(a, p) for a, p in zip(kept, m.parameters()))
    ok = diff < 1e-5 and skipped
    observed = (
        f"fused vs foreach after 3 steps: max difference {diff:.1e}; a step flagged non-finite "
        f"{'was skipped' if skipped else 'CHANGED the weights'}"
    )
    return Outcome.verdict(
        ok, observed, "fused AdamW disagrees with foreach, or applies a flagged step", max_difference=diff
    )
