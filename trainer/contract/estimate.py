"""What a run will cost, before anything is built: parameters, FLOPs, memory and the time of one step.

Torch-free, so gptop can refuse a run that cannot fit before it starts a trainer, and the trainer can say
what the first step will cost before it spends minutes building the model.

- **Parameters** are counted analytically from the size's dimensions (trainer.contract.model_shapes).
- **FLOPs per token** are torchtitan's formula as trainer.flops documents it: ``6 * N + 6 * L * H * (Q_qk +
  Q_v) * T`` with N the active non-embedding parameters.
- **Memory** of one process: the persistent training state (`state_bytes`: weights, gradients, optimizer
  state), plus the activations one
  forward/backward keeps at the starting micro-batch (the first one `--micro-batch auto` probes: 1),
  plus what the runtime itself holds (torch and its libraries on the CPU, the CUDA context on a GPU). The
  activations are counted per token from the shapes (the tensors autograd saves in each layer, the logits
  and their fp32 loss copies) and are an estimate, within a factor of about 1.5 of the measured peak.
- **The persistent state** follows the run's `--optimizer`, `--lora R`, `--lora-targets` and
  `--quantize-base`, counted per tensor from the shapes (`tensor_shapes`) as the optimizers allocate it:
  weights 4 B per parameter (fp32; autocast keeps fp32 master weights) and gradients 4 B per *trained*
  parameter. Optimizer state per trained tensor (`optimizer_state_bytes`), each plus a 4 B step count:
  `adamw` two fp32 moments, 8 B per parameter (torch.optim.AdamW); `adamw-8bit` / `adamw-4bit` (torchao.optim
  AdamW8bit / AdamW4bit, torchao/optim/README.md: block-wise quantization, default block 256 / 128) two
  moments of 1 B / 0.5 B codes per parameter plus one fp32 scale per block and the code table (256 / 16 fp32
  values) per moment, about 2.03 / 1.06 B per parameter; torchao keeps fp32 moments (8 B) for a tensor under
  4096 values or not a multiple of the block ("follow bitsandbytes", torchao/optim/adam.py); `adafactor`
  (torch.optim.Adafactor, no first moment) keeps for a matrix only a row and a column vector of the second
  moment, 4 B x (rows + columns) (a 3-D tensor: per leading index), and a full fp32 second moment for a
  vector: for a d x d matrix 8/d B per parameter, a small fraction of AdamW's 8. With LoRA only the adapters
  (A: R x in, B: out x R per targeted linear layer, fp32) have gradients and optimizer state; the frozen
  base keeps its weights only, the targeted-or-not linear layers' at 0.5 B (nf4 codes) + 1/64 B (their
  8-bit absmax per 64 values, double quantization) with `--quantize-base nf4`, 1 B + a fp32 scale per row
  with `int8`, the embeddings, norms, output head and deepseek's routed experts (not linear layers) at 4 B.
  tests/test_estimate.py checks the optimizer state against torch's after a step of the built tiny models.
- **Step time** = FLOPs per token x tokens per step / (peak FLOP/s x an assumed MFU, `ASSUMED_MFU`). The
  peak is the trainer's (trainer.flops: a GPU's datasheet, or the CPU's measured matmul rate); a caller
  without one gets no time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .common import FAMILIES as FAMILIES
from .config_schema import AUTO
from .events import EstimateInfo
from .model_shapes import (
    DEFAULT_VOCAB,
    SIZE_ORDER as SIZE_ORDER,
    SIZES as SIZES,
    Tensor,
    adapted_tensors as adapted_tensors,
    check_lora as check_lora,
    padded_vocab,
    param_counts,
    tensor_shapes,
    trained_tensors,
)

GiB = 1 << 30

# Bytes of persistent training state per parameter of a full AdamW run: fp32 weights 4 + gradients 4 + AdamW
# exp_avg 4 + exp_avg_sq 4 (a rule of thumb for docs and tables; `estimate` and `state_bytes` count the run's
# own optimizer, LoRA and quantized base).
TRAIN_BYTES_PER_PARAM = 16
# torchao's low-bit AdamW (torchao/optim/adam.py, README.md): codes per value (bytes), quantization block,
# code-table size; tensors under QUANTIZE_MIN values (or not a multiple of the block) keep fp32 moments.
LOW_BIT = {"adamw-8bit": (1.0, 256, 256), "adamw-4bit": (0.5, 128, 16)}
QUANTIZE_MIN = 4096
# A frozen base's linear-layer weight with --quantize-base: bytes per value (nf4: 4-bit codes + an 8-bit
# absmax per 64 values, double quantization; int8: 1 byte, plus a fp32 scale per row counted apart).
QUANTIZED_BASE_BYTES = {"nf4": 0.5 + 1 / 64, "int8": 1.0}
# Memory the runtime holds besides the model: torch, its libraries and the data on the CPU; the CUDA context
# and allocator slack on a GPU.
RUNTIME_BYTES = {"cpu": int(0.75 * GiB), "cuda": int(1.0 * GiB)}
# Share of the device's memory a run may plan to use (the OS, other processes, fragmentation keep the rest).
USABLE_SHARE = 0.9
# MFU assumed for the step-time estimate: about what an eager fp32 run of these models reaches on a CPU
# (BENCHMARKS.md has the measurement) and a modest figure for a GPU; the real MFU is measured from the first step on.
ASSUMED_MFU = 0.4
# Eager PyTorch's fixed cost of a step whatever its FLOPs (Python, dispatch, kernel launches): about this much per
# layer and micro-batch, the embedding and the head with its loss counted as two more layers, plus the optimizer's
# step. A floor under the FLOP-based time, which alone says "~0 ms" for a tiny model on a GPU; BENCHMARKS.md §18
# has the measurement it rests on.
OVERHEAD_PER_LAYER_S = 0.002
OPTIMIZER_OVERHEAD_S = 0.002
# A step slower than this is worth a warning before the first one: a user waits minutes to see any progress.
SLOW_STEP_S = 60.0


def optimizer_state_bytes(optimizer: str, tensors: list[Tensor]) -> int:
    """Bytes `optimizer` keeps for `tensors` once it has stepped (see the module docstring for the sources)."""
    total = 0
    for t in tensors:
        n = t.numel
        if optimizer == "adafactor":
            if len(t.shape) > 1:
                lead = math.prod(t.shape[:-2])
                b = 4 * lead * (t.shape[-2] + t.shape[-1])
            else:
                b = 4 * n
        elif optimizer in LOW_BIT and n >= QUANTIZE_MIN and n % LOW_BIT[optimizer][1] == 0:
            code, block, table = LOW_BIT[optimizer]
            b = int(2 * (n * code + 4 * (n // block) + 4 * table))
        else:  # adamw, and the low-bit ones' small tensors: fp32 moments
            b = 8 * n
        total += (b + 4) * t.count  # + the step count (a fp32 scalar tensor)
    return total


def weight_bytes(
    family: str, size: str, lora: int = 0, quantize_base: str = "none", vocab_size: int = DEFAULT_VOCAB
) -> int:
    """Bytes of the weights: fp32, with a quantized frozen base's linear layers (not the output head,
    which bitsandbytes keeps) at QUANTIZED_BASE_BYTES, plus the adapters' fp32 weights."""
    total = 0
    for t in tensor_shapes(family, size, vocab_size):
        q = QUANTIZED_BASE_BYTES.get(quantize_base) if lora else None
        if q is not None and t.linear and t.linear != "lm_head":
            total += int(t.numel * q + (4 * t.shape[0] if quantize_base == "int8" else 0)) * t.count
        else:
            total += 4 * t.numel * t.count
    return total


def fmt_size(b: float) -> str:
    """Bytes for a line of the estimate: '1.2 GiB', or '24 MiB' / '12 KiB' below a tenth of a GiB."""
    if b >= GiB / 10:
        return f"{b / GiB:.1f} GiB"
    if b >= 1 << 20:
        return f"{b / (1 << 20):.0f} MiB"
    return f"{b / 1024:.0f} KiB"


def flops_per_token(family: str, size: str, seq_len: int, vocab_size: int = DEFAULT_VOCAB) -> int:
    """Training FLOPs per token (forward + backward), torchtitan's formula (trainer.flops)."""
    d = SIZES[size]
    c = param_counts(family, size, vocab_size)
    if family == "deepseek":
        qk, vh = d.qk_nope + d.qk_rope, d.v_head
    else:
        qk = vh = d.hidden // d.heads
    return int(6 * (c.active - c.embedding) + 6 * d.layers * d.heads * (qk + vh) * seq_len)


def activation_bytes_per_token(
    family: str,
    size: str,
    seq_len: int,
    precision: str = "fp32",
    vocab_size: int = DEFAULT_VOCAB,
    checkpointing: bool = False,
) -> int:
    """Bytes autograd keeps per token of a micro-batch between forward and backward (an estimate)."""
    d = SIZES[size]
    h = d.hidden
    act = 2 if precision in ("bf16", "fp16") or precision.startswith("fp8") else 4
    if family == "deepseek":
        qk = d.qk_nope + d.qk_rope
        attn = (
            4 * h
            + 3 * d.heads * qk
            + 3 * d.heads * d.v_head
            + 3 * d.kv_lora
            + d.qk_rope
            + d.heads * (d.qk_nope + d.v_head)
        )
        moe = d.top_k * (h + 4 * d.moe_ffn) + d.shared * 4 * d.moe_ffn + 3 * d.experts + 2 * h
        layers = attn * d.layers + 4 * d.ffn + moe * (d.layers - 1)
    else:
        layers = d.layers * (12 * h + 4 * d.ffn)
    if checkpointing:
        layers = d.layers * h + layers // d.layers  # layer inputs kept, one layer recomputed at a time
    v = padded_vocab(family, vocab_size)
    logits = v * act + 3 * v * 4  # the head's output, and the loss's fp32 copies and grads
    return int(layers * act + logits + h * 4)


@dataclass(frozen=True)
class Estimate:
    """What one process of a run needs, before it is built."""

    family: str
    size: str
    total_params: int
    active_params: int
    flops_per_token: int
    state_bytes: int  # weights + gradients + optimizer state
    optimizer_bytes: int  # the optimizer state alone (part of state_bytes)
    activation_bytes: int  # at `micro_batch`
    runtime_bytes: int
    micro_batch: int
    tokens_per_step: int
    capacity: int | None  # usable bytes of the device (RAM on the CPU), None if unknown
    step_s: float | None  # None without a peak
    device: str = "cpu"
    optimizer: str = "adamw"
    trainable_params: int = 0  # parameters with gradients (all, or the LoRA adapters)

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + self.runtime_bytes

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total_bytes <= self.capacity

    @property
    def slow(self) -> bool:
        return self.step_s is not None and self.step_s > SLOW_STEP_S

    def to_info(self) -> EstimateInfo:
        """The estimate as the early hello carries it (bytes, seconds)."""
        return EstimateInfo(
            params=self.total_params,
            active_params=self.active_params,
            flops_per_token=self.flops_per_token,
            state_bytes=self.state_bytes,
            optimizer_bytes=self.optimizer_bytes,
            activation_bytes=self.activation_bytes,
            runtime_bytes=self.runtime_bytes,
            total_bytes=self.total_bytes,
            capacity_bytes=self.capacity,
            micro_batch=self.micro_batch,
            step_s=self.step_s,
            assumed_mfu=ASSUMED_MFU,
        )

    def summary(self, where: str, steps: int | None = None, optimizer: bool = True) -> str:
        """'deepseek medium on this CPU: ~14.2 GiB (optimizer 6.8 GiB), ~3.5 min per step' (', ~2.5 h for 40
        steps' with `steps`; without the optimizer's part where the caller itemizes the memory)."""
        out = f"{self.family} {self.size} on {where}: ~{self.total_bytes / GiB:.1f} GiB"
        if optimizer:
            out += f" (optimizer {fmt_size(self.optimizer_bytes)})"
        if self.step_s is not None:
            out += f", ~{fmt_seconds(self.step_s)} per step"
            if steps:
                out += f", ~{fmt_seconds(self.step_s * steps)} for {steps} steps"
        return out


def fmt_seconds(s: float) -> str:
    """12.3 -> '12 s', 250 -> '4.2 min', 9000 -> '2.5 h'."""
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def estimate(
    family: str,
    size: str,
    *,
    seq_len: int,
    global_batch: int,
    micro_batch: int | None,
    precision: str = "fp32",
    device: str = "cpu",
    capacity: int | None = None,
    peak_flops: float | None = None,
    world_size: int = 1,
    vocab_size: int = DEFAULT_VOCAB,
    checkpointing: bool = False,
    fsdp: bool = False,
    optimizer: str = "adamw",
    lora: int = 0,
    lora_targets: str = AUTO,
    quantize_base: str = "none",
) -> Estimate:
    """The estimate of one rank. `micro_batch` None (auto) counts the first probe's (1); `capacity` is the
    device's total memory (the usable share is taken here); `peak_flops` one rank's peak, None: no time;
    `optimizer`, `lora` (R, 0: full training), `lora_targets` and `quantize_base` as the config has them
    (`run_options` reads them)."""
    c = param_counts(family, size, vocab_size)
    fpt = flops_per_token(family, size, seq_len, vocab_size)
    mb = micro_batch or 1
    shards = world_size if fsdp else 1
    state, opt, n_trained = _state(family, size, optimizer, lora, lora_targets, quantize_base, vocab_size, shards)
    act = activation_bytes_per_token(family, size, seq_len, precision, vocab_size, checkpointing) * mb * seq_len
    tokens = global_batch * seq_len
    step_s = None
    if peak_flops:
        micro_batches = max(1, math.ceil(global_batch / world_size / mb))
        floor = micro_batches * (SIZES[size].layers + 2) * OVERHEAD_PER_LAYER_S + OPTIMIZER_OVERHEAD_S
        step_s = max(fpt * tokens / world_size / (peak_flops * ASSUMED_MFU), floor)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return Estimate(
        family=family,
        size=size,
        total_params=c.total,
        active_params=c.active,
        flops_per_token=fpt,
        state_bytes=state,
        activation_bytes=act,
        runtime_bytes=RUNTIME_BYTES[kind],
        micro_batch=mb,
        tokens_per_step=tokens,
        capacity=int(capacity * USABLE_SHARE) if capacity else None,
        step_s=step_s,
        device=kind,
        optimizer_bytes=opt,
        optimizer=optimizer,
        trainable_params=n_trained,
    )


def _state(
    family: str,
    size: str,
    optimizer: str,
    lora: int,
    lora_targets: str,
    quantize_base: str,
    vocab_size: int,
    shards: int,
) -> tuple[int, int, int]:
    """(persistent state bytes, of which optimizer state, trained parameters) of one rank."""
    trained = trained_tensors(family, size, lora, lora_targets, vocab_size)
    n_trained = sum(t.numel * t.count for t in trained)
    opt = optimizer_state_bytes(optimizer, trained) // shards
    return (weight_bytes(family, size, lora, quantize_base, vocab_size) + 4 * n_trained) // shards + opt, opt, n_trained


def state_bytes(
    family: str,
    size: str,
    *,
    optimizer: str = "adamw",
    lora: int = 0,
    lora_targets: str = AUTO,
    quantize_base: str = "none",
    vocab_size: int = DEFAULT_VOCAB,
) -> int:
    """The persistent training state of one process (weights, gradients of what trains, optimizer state) as
    `estimate` counts it, without the activations: what `--size auto` plans with (capabilities.auto_size),
    so a run with a low-bit optimizer or LoRA is offered the larger size its smaller state allows."""
    return _state(family, size, optimizer, lora, lora_targets, quantize_base, vocab_size, 1)[0]


def run_options(cfg: Any) -> dict[str, Any]:
    """The estimate's arguments that a TrainConfig's optimizer toggles and fine-tuning section set."""
    ft = cfg.finetune
    return dict(
        optimizer=cfg.toggles.optimizer,
        lora=ft.lora,
        lora_targets=ft.lora_targets,
        quantize_base=cfg.toggles.quantize_base,
    )


def largest_fitting(family: str, **kw: Any) -> str | None:
    """The largest size of `family` whose estimate fits (same arguments as `estimate`), or None."""
    best = None
    for size in SIZE_ORDER:
        if estimate(family, size, **kw).fits:
            best = size
    return best


def refusal(est: Estimate, where: str, fitting: str | None) -> str:
    """The one line of a run that cannot fit: the estimate, and what to do."""
    parts = (
        f"{(est.state_bytes - est.optimizer_bytes) / GiB:.1f} GiB weights and gradients + "
        f"{fmt_size(est.optimizer_bytes)} {est.optimizer} state + "
        f"{est.activation_bytes / GiB:.1f} GiB activations at micro-batch {est.micro_batch} + "
        f"{est.runtime_bytes / GiB:.1f} GiB runtime"
    )
    cap = f"{est.capacity / GiB:.1f} GiB usable" if est.capacity else "the memory"
    what = (
        f"the largest {est.family} size that fits is {fitting}: use --size {fitting}"
        if fitting
        else f"no {est.family} size fits; use a smaller --seq-len or --micro-batch, or a larger device"
    )
    return f"{est.summary(where, optimizer=False)} ({parts}) does not fit in {cap}; {what}"
