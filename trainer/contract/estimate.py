"""What a run will cost, before anything is built: parameters, FLOPs, memory and the time of one step.

Torch-free, so gptop can refuse a run that cannot fit before it starts a trainer, and the trainer can say
what the first step will cost before it spends minutes building the model (issue 11 §2).

- **Parameters** are counted analytically from the size's dimensions (`SIZES`) for the stock transformers
  classes the families build (`LlamaForCausalLM`, `DeepseekV3ForCausalLM` with multi-head latent attention
  and no query compression, untied embeddings, no biases); tests/test_estimate.py checks every family and
  size against the real model built on the meta device.
- **FLOPs per token** are torchtitan's formula as trainer.flops documents it: ``6 * N + 6 * L * H * (Q_qk +
  Q_v) * T`` with N the active non-embedding parameters.
- **Memory** of one process: the persistent training state, 16 bytes per parameter (fp32 weights 4,
  gradients 4, AdamW's two moments 8; autocast keeps fp32 master weights), plus the activations one
  forward/backward keeps at the starting micro-batch (the first one `--micro-batch auto` probes: 1),
  plus what the runtime itself holds (torch and its libraries on the CPU, the CUDA context on a GPU). The
  activations are counted per token from the shapes (the tensors autograd saves in each layer, the logits
  and their fp32 loss copies) and are an estimate, within a factor of about 1.5 of the measured peak.
- **Step time** = FLOPs per token x tokens per step / (peak FLOP/s x an assumed MFU, `ASSUMED_MFU`). The
  peak is the trainer's (trainer.flops: a GPU's datasheet, or the CPU's measured matmul rate); a caller
  without one gets no time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GiB = 1 << 30
SIZE_ORDER = ("tiny", "small", "medium", "large")
FAMILIES = ("llama", "deepseek", "llada")
VOCAB_MULTIPLE = 64
DEFAULT_VOCAB = 8192          # the builtin BPE tokenizer

# Bytes of persistent training state per parameter: fp32 weights 4 + gradients 4 + AdamW exp_avg 4 + exp_avg_sq 4.
TRAIN_BYTES_PER_PARAM = 16
# Memory the runtime holds besides the model: torch, its libraries and the data on the CPU; the CUDA context
# and allocator slack on a GPU.
RUNTIME_BYTES = {"cpu": int(0.75 * GiB), "cuda": int(1.0 * GiB)}
# Share of the device's memory a run may plan to use (the OS, other processes, fragmentation keep the rest).
USABLE_SHARE = 0.9
# MFU assumed for the step-time estimate: what an eager fp32 run of these models reaches on this project's CPU
# (BENCHMARKS.md) and a modest figure for a GPU; the real MFU is measured from the first step on.
ASSUMED_MFU = 0.4
# A step slower than this is worth a warning before the first one (issue 11: "about a minute").
SLOW_STEP_S = 60.0


@dataclass(frozen=True)
class Dims:
    """Width, depth and attention shape of one size (shared by all families)."""

    hidden: int
    layers: int
    heads: int
    ffn: int                  # SwiGLU intermediate size of dense MLPs
    # MLA (deepseek): per-head dims and the compressed KV rank
    qk_nope: int
    qk_rope: int
    v_head: int
    kv_lora: int
    # MoE (deepseek): routed experts, experts per token, shared experts, expert width, routing groups
    experts: int
    top_k: int
    shared: int
    moe_ffn: int
    groups: int
    topk_groups: int


# The expert width is chosen so that the active parameters per token of a deepseek
# size match the llama size of the same name (see docs/models.md for the counts).
# Routing groups: experts/groups >= 2 (a group's score is its top-2 experts) and
# topk_groups * experts/groups >= top_k, so group-limited routing is well defined.
SIZES: dict[str, Dims] = {
    "tiny": Dims(hidden=128, layers=4, heads=4, ffn=384, qk_nope=32, qk_rope=16, v_head=32, kv_lora=64,
                 experts=8, top_k=2, shared=1, moe_ffn=128, groups=2, topk_groups=1),
    "small": Dims(hidden=768, layers=16, heads=12, ffn=2048, qk_nope=64, qk_rope=32, v_head=64, kv_lora=256,
                  experts=16, top_k=4, shared=1, moe_ffn=448, groups=4, topk_groups=2),
    "medium": Dims(hidden=1024, layers=24, heads=16, ffn=3072, qk_nope=64, qk_rope=32, v_head=64, kv_lora=384,
                   experts=16, top_k=4, shared=1, moe_ffn=640, groups=4, topk_groups=2),
    "large": Dims(hidden=2048, layers=20, heads=16, ffn=5632, qk_nope=128, qk_rope=64, v_head=128, kv_lora=512,
                  experts=16, top_k=4, shared=1, moe_ffn=1216, groups=4, topk_groups=2),
}


def padded_vocab(family: str, vocab_size: int = DEFAULT_VOCAB) -> int:
    """The model's vocabulary for a tokenizer of `vocab_size` (llada adds a mask slot), a multiple of 64."""
    n = vocab_size + (1 if family == "llada" else 0)
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int               # per token: routed experts count top_k / experts of their size
    embedding: int            # the input embedding (a lookup, not a matmul)


def param_counts(family: str, size: str, vocab_size: int = DEFAULT_VOCAB) -> ParamCounts:
    """Parameters of a family at a size, counted from the dimensions (no model is built)."""
    d = SIZES[size]
    v = padded_vocab(family, vocab_size)
    h = d.hidden
    embed = v * h
    head = v * h                                        # untied output head
    norms = 2 * h                                       # per layer: input and post-attention RMSNorm
    if family == "deepseek":
        qk = d.qk_nope + d.qk_rope
        attn = (h * d.heads * qk                        # q_proj (no query compression)
                + h * (d.kv_lora + d.qk_rope)           # kv_a_proj_with_mqa
                + d.kv_lora                             # kv_a_layernorm
                + d.kv_lora * d.heads * (d.qk_nope + d.v_head)   # kv_b_proj
                + d.heads * d.v_head * h)               # o_proj
        dense_mlp = 3 * h * d.ffn
        expert = 3 * h * d.moe_ffn
        routed = d.experts * expert
        moe_rest = d.shared * expert + d.experts * h    # shared experts, router weight (its bias is a buffer)
        total = embed + head + h + d.layers * (attn + norms) + dense_mlp + (d.layers - 1) * (routed + moe_rest)
        active = total - (d.layers - 1) * routed + (d.layers - 1) * (routed * d.top_k // d.experts)
        return ParamCounts(total, active, embed)
    attn = 4 * h * h                                    # q, k, v, o (as many KV heads as heads)
    layer = attn + 3 * h * d.ffn + norms
    total = embed + head + h + d.layers * layer
    return ParamCounts(total, total, embed)


def flops_per_token(family: str, size: str, seq_len: int, vocab_size: int = DEFAULT_VOCAB) -> int:
    """Training FLOPs per token (forward + backward), torchtitan's formula (trainer.flops)."""
    d = SIZES[size]
    c = param_counts(family, size, vocab_size)
    if family == "deepseek":
        qk, vh = d.qk_nope + d.qk_rope, d.v_head
    else:
        qk = vh = d.hidden // d.heads
    return int(6 * (c.active - c.embedding) + 6 * d.layers * d.heads * (qk + vh) * seq_len)


def activation_bytes_per_token(family: str, size: str, seq_len: int, precision: str = "fp32",
                               vocab_size: int = DEFAULT_VOCAB, checkpointing: bool = False) -> int:
    """Bytes autograd keeps per token of a micro-batch between forward and backward (an estimate)."""
    d = SIZES[size]
    h = d.hidden
    act = 2 if precision in ("bf16", "fp16") or precision.startswith("fp8") else 4
    if family == "deepseek":
        qk = d.qk_nope + d.qk_rope
        attn = (4 * h + 3 * d.heads * qk + 3 * d.heads * d.v_head + 3 * d.kv_lora + d.qk_rope
                + d.heads * (d.qk_nope + d.v_head))
        moe = d.top_k * (h + 4 * d.moe_ffn) + d.shared * 4 * d.moe_ffn + 3 * d.experts + 2 * h
        layers = attn * d.layers + 4 * d.ffn + moe * (d.layers - 1)
    else:
        layers = d.layers * (12 * h + 4 * d.ffn)
    if checkpointing:
        layers = d.layers * h + layers // d.layers      # layer inputs kept, one layer recomputed at a time
    v = padded_vocab(family, vocab_size)
    logits = v * act + 3 * v * 4                        # the head's output, and the loss's fp32 copies and grads
    return int(layers * act + logits + h * 4)


@dataclass(frozen=True)
class Estimate:
    """What one process of a run needs, before it is built."""

    family: str
    size: str
    total_params: int
    active_params: int
    flops_per_token: int
    state_bytes: int          # weights + gradients + optimizer state
    activation_bytes: int     # at `micro_batch`
    runtime_bytes: int
    micro_batch: int
    tokens_per_step: int
    capacity: int | None      # usable bytes of the device (RAM on the CPU), None if unknown
    step_s: float | None      # None without a peak
    device: str = "cpu"

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + self.runtime_bytes

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total_bytes <= self.capacity

    @property
    def slow(self) -> bool:
        return self.step_s is not None and self.step_s > SLOW_STEP_S

    def to_dict(self) -> dict[str, Any]:
        """The estimate as the early hello carries it (bytes, seconds)."""
        return {"params": self.total_params, "active_params": self.active_params,
                "flops_per_token": self.flops_per_token, "state_bytes": self.state_bytes,
                "activation_bytes": self.activation_bytes, "runtime_bytes": self.runtime_bytes,
                "total_bytes": self.total_bytes, "capacity_bytes": self.capacity, "micro_batch": self.micro_batch,
                "step_s": self.step_s, "assumed_mfu": ASSUMED_MFU}

    def summary(self, where: str, steps: int | None = None) -> str:
        """'deepseek medium on this CPU: ~14.2 GiB, ~3.5 min per step' (', ~2.5 h for 40 steps' with `steps`)."""
        out = f"{self.family} {self.size} on {where}: ~{self.total_bytes / GiB:.1f} GiB"
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


def estimate(family: str, size: str, *, seq_len: int, global_batch: int, micro_batch: int | None,
             precision: str = "fp32", device: str = "cpu", capacity: int | None = None,
             peak_flops: float | None = None, world_size: int = 1, vocab_size: int = DEFAULT_VOCAB,
             checkpointing: bool = False, fsdp: bool = False) -> Estimate:
    """The estimate of one rank. `micro_batch` None (auto) counts the first probe's (1); `capacity` is the
    device's total memory (the usable share is taken here); `peak_flops` one rank's peak, None: no time."""
    c = param_counts(family, size, vocab_size)
    fpt = flops_per_token(family, size, seq_len, vocab_size)
    mb = micro_batch or 1
    state = c.total * TRAIN_BYTES_PER_PARAM // (world_size if fsdp else 1)
    act = activation_bytes_per_token(family, size, seq_len, precision, vocab_size, checkpointing) * mb * seq_len
    tokens = global_batch * seq_len
    step_s = None
    if peak_flops:
        step_s = fpt * tokens / world_size / (peak_flops * ASSUMED_MFU)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return Estimate(family=family, size=size, total_params=c.total, active_params=c.active, flops_per_token=fpt,
                    state_bytes=state, activation_bytes=act, runtime_bytes=RUNTIME_BYTES[kind], micro_batch=mb,
                    tokens_per_step=tokens, capacity=int(capacity * USABLE_SHARE) if capacity else None,
                    step_s=step_s, device=kind)


def largest_fitting(family: str, **kw: Any) -> str | None:
    """The largest size of `family` whose estimate fits (same arguments as `estimate`), or None."""
    best = None
    for size in SIZE_ORDER:
        if estimate(family, size, **kw).fits:
            best = size
    return best


def refusal(est: Estimate, where: str, fitting: str | None) -> str:
    """The one line of a run that cannot fit: the estimate, and what to do."""
    parts = (f"{est.state_bytes / GiB:.1f} GiB weights, gradients and AdamW state + "
             f"{est.activation_bytes / GiB:.1f} GiB activations at micro-batch {est.micro_batch} + "
             f"{est.runtime_bytes / GiB:.1f} GiB runtime")
    cap = f"{est.capacity / GiB:.1f} GiB usable" if est.capacity else "the memory"
    what = (f"the largest {est.family} size that fits is {fitting}: use --size {fitting}" if fitting
            else f"no {est.family} size fits; use a smaller --seq-len or --micro-batch, or a larger device")
    return f"{est.summary(where)} ({parts}) does not fit in {cap}; {what}"
