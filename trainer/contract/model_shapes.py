"""The model families' sizes and the parameter tensors they imply: counts, shapes and LoRA targets, from the
dimensions alone (torch-free; no model is built).

Parameters are counted analytically for the stock transformers classes the families build (`LlamaForCausalLM`,
`DeepseekV3ForCausalLM` with multi-head latent attention and no query compression, untied embeddings, no
biases); tests/test_estimate.py checks every family and size against the real model built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .common import FAMILIES, ConfigError
from .config_schema import AUTO, LORA_DEFAULT_TARGETS

SIZE_ORDER = ("tiny", "small", "medium", "large")
VOCAB_MULTIPLE = 64
DEFAULT_VOCAB = 8192  # the builtin BPE tokenizer


@dataclass(frozen=True)
class Dims:
    """Width, depth and attention shape of one size (shared by all families)."""

    hidden: int
    layers: int
    heads: int
    ffn: int  # SwiGLU intermediate size of dense MLPs
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
    "tiny": Dims(
        hidden=128,
        layers=4,
        heads=4,
        ffn=384,
        qk_nope=32,
        qk_rope=16,
        v_head=32,
        kv_lora=64,
        experts=8,
        top_k=2,
        shared=1,
        moe_ffn=128,
        groups=2,
        topk_groups=1,
    ),
    "small": Dims(
        hidden=768,
        layers=16,
        heads=12,
        ffn=2048,
        qk_nope=64,
        qk_rope=32,
        v_head=64,
        kv_lora=256,
        experts=16,
        top_k=4,
        shared=1,
        moe_ffn=448,
        groups=4,
        topk_groups=2,
    ),
    "medium": Dims(
        hidden=1024,
        layers=24,
        heads=16,
        ffn=3072,
        qk_nope=64,
        qk_rope=32,
        v_head=64,
        kv_lora=384,
        experts=16,
        top_k=4,
        shared=1,
        moe_ffn=640,
        groups=4,
        topk_groups=2,
    ),
    "large": Dims(
        hidden=2048,
        layers=20,
        heads=16,
        ffn=5632,
        qk_nope=128,
        qk_rope=64,
        v_head=128,
        kv_lora=512,
        experts=16,
        top_k=4,
        shared=1,
        moe_ffn=1216,
        groups=4,
        topk_groups=2,
    ),
}


def padded_vocab(family: str, vocab_size: int = DEFAULT_VOCAB) -> int:
    """The model's vocabulary for a tokenizer of `vocab_size` (llada adds a mask slot), a multiple of 64."""
    n = vocab_size + (1 if family == "llada" else 0)
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # per token: routed experts count top_k / experts of their size
    embedding: int  # the input embedding (a lookup, not a matmul)


def param_counts(family: str, size: str, vocab_size: int = DEFAULT_VOCAB) -> ParamCounts:
    """Parameters of a family at a size, counted from the dimensions (no model is built)."""
    d = SIZES[size]
    v = padded_vocab(family, vocab_size)
    h = d.hidden
    embed = v * h
    head = v * h  # untied output head
    norms = 2 * h  # per layer: input and post-attention RMSNorm
    if family == "deepseek":
        qk = d.qk_nope + d.qk_rope
        attn = (
            h * d.heads * qk  # q_proj (no query compression)
            + h * (d.kv_lora + d.qk_rope)  # kv_a_proj_with_mqa
            + d.kv_lora  # kv_a_layernorm
            + d.kv_lora * d.heads * (d.qk_nope + d.v_head)  # kv_b_proj
            + d.heads * d.v_head * h
        )  # o_proj
        dense_mlp = 3 * h * d.ffn
        expert = 3 * h * d.moe_ffn
        routed = d.experts * expert
        moe_rest = d.shared * expert + d.experts * h  # shared experts, router weight (its bias is a buffer)
        total = embed + head + h + d.layers * (attn + norms) + dense_mlp + (d.layers - 1) * (routed + moe_rest)
        active = total - (d.layers - 1) * routed + (d.layers - 1) * (routed * d.top_k // d.experts)
        return ParamCounts(total, active, embed)
    attn = 4 * h * h  # q, k, v, o (as many KV heads as heads)
    layer = attn + 3 * h * d.ffn + norms
    total = embed + head + h + d.layers * layer
    return ParamCounts(total, total, embed)


@dataclass(frozen=True)
class Tensor:
    """`count` parameters of one shape; `linear` names the linear layer it is the weight of ('' if none),
    `fused` the fused 3-D expert parameter it is (deepseek's routed experts: gate_up_proj, down_proj)."""

    shape: tuple[int, ...]
    count: int = 1
    linear: str = ""
    fused: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_shapes(family: str, size: str, vocab_size: int = DEFAULT_VOCAB) -> list[Tensor]:
    """Every parameter tensor of a family at a size, by shape (linear weights are (out, in), as torch holds
    them; deepseek's routed experts are fused 3-D tensors). Sums to `param_counts(...).total` (a test checks)."""
    d = SIZES[size]
    v, h, n = padded_vocab(family, vocab_size), d.hidden, d.layers
    out = [Tensor((v, h)), Tensor((v, h), linear="lm_head"), Tensor((h,)), Tensor((h,), 2 * n)]

    def mlp(width: int, count: int) -> list[Tensor]:
        return [
            Tensor((width, h), count, "gate_proj"),
            Tensor((width, h), count, "up_proj"),
            Tensor((h, width), count, "down_proj"),
        ]

    if family != "deepseek":
        return out + [Tensor((h, h), n, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")] + mlp(d.ffn, n)
    qk = d.qk_nope + d.qk_rope
    moe = n - 1
    return out + [
        Tensor((d.heads * qk, h), n, "q_proj"),
        Tensor((d.kv_lora + d.qk_rope, h), n, "kv_a_proj_with_mqa"),
        Tensor((d.kv_lora,), n),
        Tensor((d.heads * (d.qk_nope + d.v_head), d.kv_lora), n, "kv_b_proj"),
        Tensor((h, d.heads * d.v_head), n, "o_proj"),
        *mlp(d.ffn, 1),
        *mlp(d.shared * d.moe_ffn, moe),
        Tensor((d.experts, 2 * d.moe_ffn, h), moe, fused="gate_up_proj"),
        Tensor((d.experts, h, d.moe_ffn), moe, fused="down_proj"),
        Tensor((d.experts, h), moe),
    ]


def lora_targets(family: str, targets: str = AUTO) -> list[str]:
    """The linear layers that get adapters: `--lora-targets auto` picks the attention and MLP projections
    the family has (config.LORA_DEFAULT_TARGETS, the rule trainer.lora applies to the built model)."""
    names = {t.linear for t in tensor_shapes(family, "tiny") if t.linear}
    wanted = LORA_DEFAULT_TARGETS if targets == AUTO else tuple(targets.split(","))
    return [n for n in wanted if n in names]


def lora_targetable(family: str) -> list[str]:
    """The linear layers `--lora-targets` may name for a family: every one but the output head (the head and
    the embeddings are never adapted, trainer.lora)."""
    return sorted({t.linear for t in tensor_shapes(family, "tiny") if t.linear} - {"lm_head"})


def check_lora(family: str, size: str, lora: int, targets: str = AUTO) -> None:
    """A LoRA run's targets and rank for a family, from its dimensions (no model built), before anything is
    created: a target the family lacks, or a rank above the smallest dimension of a layer it adapts (such an
    adapter is no low-rank update, and has more parameters than the layer), is a ConfigError. trainer.lora
    applies the same rule to any built model, a model directory's too."""
    if not lora or family not in FAMILIES:
        return
    if targets != AUTO:
        can = lora_targetable(family)
        missing = [n for n in targets.split(",") if n not in can]
        if missing:
            head = " (the output head is never adapted)" if "lm_head" in missing else ""
            raise ConfigError(
                "--lora-targets",
                f"{','.join(missing)}: no layer of that name to adapt in {family}"
                f"{head}; what can be targeted: {','.join(can)} (or auto)",
            )
    chosen = adapted_tensors(family, size, targets)
    if not chosen:
        return
    smallest = min(chosen, key=lambda t: min(t.shape[-2:]))
    limit = min(smallest.shape[-2:])
    if lora > limit:
        name = smallest.linear or smallest.fused
        raise ConfigError(
            "--lora",
            f"{lora} is above {limit}, the smallest dimension of the layers it adapts in "
            f"{family} {size} ({name} is {smallest.shape[-2]}x{smallest.shape[-1]}): such an "
            f"adapter is no low-rank update and has more parameters than the layer; use "
            f"--lora {limit} or less",
        )


def trained_tensors(
    family: str, size: str, lora: int = 0, targets: str = AUTO, vocab_size: int = DEFAULT_VOCAB
) -> list[Tensor]:
    """The tensors that have gradients and optimizer state: all of them, or with `lora` R the adapters
    A (R x in) and B (out x R) of every targeted linear layer.

    A model with fused experts (deepseek) is adapted the way peft (0.21 with transformers 5, as installed) maps MLP
    targets onto it: gate_proj / up_proj / down_proj become adapters of the fused expert parameters (one
    A (R*E x in), B (out x R*E) per parameter, rank doubled for gate_up_proj, which holds two matrices) and
    the dense and shared-expert MLPs of those names get none; tests/test_estimate.py checks the counts
    against the built model."""
    if not lora:
        return tensor_shapes(family, size, vocab_size)
    out = []
    for t in adapted_tensors(family, size, targets, vocab_size):
        if t.linear:
            rows, cols = t.shape
            out += [Tensor((lora, cols), t.count), Tensor((rows, lora), t.count)]
        else:
            experts, rows, cols = t.shape
            r = lora * experts * (2 if t.fused == "gate_up_proj" else 1)
            out += [Tensor((r, cols), t.count), Tensor((rows, r), t.count)]
    return out


def adapted_tensors(family: str, size: str, targets: str = AUTO, vocab_size: int = DEFAULT_VOCAB) -> list[Tensor]:
    """The weights that get LoRA adapters (see `trained_tensors` for how peft maps MLP targets onto fused
    experts)."""
    tensors = tensor_shapes(family, size, vocab_size)
    chosen = set(lora_targets(family, targets))
    fused = {t.fused for t in tensors if t.fused}
    if fused:
        mlp = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
        fused = {mlp[n] for n in chosen if n in mlp}
        chosen -= set(mlp)
    return [t for t in tensors if (t.linear and t.linear in chosen) or (t.fused and t.fused in fused)]
