"""Model families and sizes: one place that turns `--model/--size` into a torch module.

Every family is a stock Hugging Face transformers architecture built from its
config class with random initialization (no hub downloads), so checkpoints are
plain state dicts and any local HF model directory can be fine-tuned instead:

- ``llama``: LlamaConfig + LlamaForCausalLM, causal LM objective.
- ``deepseek``: DeepseekV3Config + DeepseekV3ForCausalLM: multi-head latent
  attention (MLA, no query compression, like DeepSeek-V2-Lite) and routed MoE
  with a shared expert and group-limited routing; the first layer is dense, as
  in DeepSeek-V3. Expert load is balanced without an auxiliary loss
  (trainer.moe.MoEBalancer). Sizes match the llama sizes in *active*
  parameters per token; total parameters are about 2.5-3.5x larger.
- ``llada``: the llama architecture with bidirectional (non-causal) attention,
  trained with the LLaDA masked-diffusion objective (trainer.objectives).

Sizes (llama dims; deepseek and llada use the same width, depth and heads):
``tiny`` (~3M, trains on a laptop CPU in seconds), ``small`` (~125M),
``medium`` (~350M), ``large`` (~1.06B). ``auto`` picks the largest size the
device can train, see `resolve_size`.

The vocabulary is padded up to a multiple of 64 (tensor-core friendly shapes;
fp8 needs multiples of 16). llada also needs a mask token: the data's mask id
when it has one, else the first padded slot (``vocab_size + 1`` is padded, so a
free slot always exists).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .contract.capabilities import auto_size
from .contract.common import FAMILIES
from .contract.config import ConfigError, FinetuneConfig, ModelConfig, Toggles
from .contract.inputs import is_model_path
from .contract.device import DeviceInfo
from .contract.estimate import TRAIN_BYTES_PER_PARAM  # noqa: F401
from .contract.model_shapes import DEFAULT_VOCAB, SIZE_ORDER, SIZES, VOCAB_MULTIPLE, Dims  # noqa: F401
from . import flops as _flops

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)


OBJECTIVES = {"llama": "causal", "deepseek": "causal", "llada": "llada", "pretrained": "causal"}


@dataclass
class ModelBundle:
    """A built model and the numbers the rest of the trainer needs about it."""

    model: torch.nn.Module
    family: str  # llama|deepseek|llada|pretrained
    size: str  # resolved size name, or "pretrained"
    hf_config: PretrainedConfig
    vocab_size: int  # padded
    total_params: int
    active_params: int  # per token (MoE: shared + top-k routed experts + dense parts)
    embedding_params: int
    flops_per_token: int  # for training (fwd+bwd), torchtitan formula with seq_len
    objective: str  # "causal" | "llada"
    mask_id: int | None
    trainable_params: int | None = None  # parameters that train (LoRA: the adapters); None: all of them

    def __post_init__(self) -> None:
        if self.trainable_params is None:
            self.trainable_params = self.total_params

    @property
    def is_moe(self) -> bool:
        return self.active_params < self.total_params


# --- quiet imports -------------------------------------------------------------------


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Silence import-time noise of torchao (pulled in by transformers).

    On a machine without a matching GPU torchao logs that its CUDA extensions do
    not load, and registers enums that torch's pytree deprecates. Neither is
    actionable for a user, and they would land in every run log. Only these two
    loggers are raised to ERROR, and only while importing.
    """
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def import_transformers() -> Any:
    """transformers with the model classes the families use, imported once (quietly): the last heavy import of
    the trainer's startup and of a tool's model loading, made before either builds a model (trainer.process_costs)."""
    with quiet_imports():
        import transformers

        from transformers import (  # noqa: F401  (import under the quiet context)
            AutoModelForCausalLM,
            DeepseekV3Config,
            DeepseekV3ForCausalLM,
            LlamaConfig,
            LlamaForCausalLM,
        )
    return transformers


# --- names -------------------------------------------------------------------------


def is_pretrained_path(model: str) -> bool:
    """True if `--model` names a local Hugging Face model directory rather than a family.

    A family name wins over a directory of the same name in the working
    directory; write ``./llama`` to mean the directory.
    """
    if not is_model_path(model):
        return False
    p = Path(model).expanduser()
    return p.is_dir() and (p / "config.json").is_file()


def pad_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Round a vocabulary size up to a multiple of 64."""
    return int(math.ceil(n / multiple) * multiple)


def vocab_and_mask(family: str, vocab_size: int, mask_id: int | None) -> tuple[int, int | None]:
    """Padded vocabulary and the mask token id (llada only) for a tokenizer of `vocab_size`."""
    if family != "llada":
        return pad_vocab(vocab_size), None
    if mask_id is None:
        # The first padded slot: padding vocab_size + 1 guarantees it exists.
        return pad_vocab(vocab_size + 1), vocab_size
    if mask_id < 0:
        raise ConfigError("--model", f"mask id {mask_id} is negative")
    return pad_vocab(max(vocab_size, mask_id + 1)), mask_id


# --- sizes -------------------------------------------------------------------------


def resolve_size(size: str, family: str, dev: DeviceInfo, **state_options: Any) -> str:
    """The concrete size for `--size` (``auto``: trainer.contract.capabilities.auto_size, the rule gptop
    also uses to name a run directory before the trainer starts; `state_options`: estimate.run_options)."""
    if size != "auto":
        if size not in SIZE_ORDER:
            raise ConfigError("--size", f"{size!r} is not one of {', '.join(SIZE_ORDER + ('auto',))}")
        return size
    return auto_size(family if family in FAMILIES else "llama", dev, **state_options)


# --- configs -------------------------------------------------------------------------


def hf_config(family: str, size: str, *, vocab_size: int, seq_len: int = 256, attention: str = "sdpa") -> Any:
    """The transformers config of a family at a size (`vocab_size` already padded)."""
    transformers = import_transformers()
    d = SIZES[size]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=d.hidden,
        intermediate_size=d.ffn,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.heads,
        max_position_embeddings=max(seq_len, 2048),
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation=attention,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if family in ("llama", "llada"):
        cfg = transformers.LlamaConfig(**common)
        if family == "llada":
            # Read by transformers' masking utils: a bidirectional mask instead of a causal one.
            # The attention modules' own `is_causal` flag (used by sdpa/flash when no mask is
            # materialized) is cleared in `_make_bidirectional`.
            cfg.is_causal = False
        return cfg
    if family == "deepseek":
        return transformers.DeepseekV3Config(
            **common,
            moe_intermediate_size=d.moe_ffn,
            n_routed_experts=d.experts,
            num_experts_per_tok=d.top_k,
            n_shared_experts=d.shared,
            n_group=d.groups,
            topk_group=d.topk_groups,
            first_k_dense_replace=1,
            # Gate weights of the chosen experts are normalized to sum to 1 (as in DeepSeek-V3);
            # V3's routed_scaling_factor of 2.5 was tuned for 8-of-256 routing, here it is 1.
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            q_lora_rank=None,
            kv_lora_rank=d.kv_lora,
            qk_nope_head_dim=d.qk_nope,
            qk_rope_head_dim=d.qk_rope,
            v_head_dim=d.v_head,
            num_mtp_layers=0,
        )
    raise ConfigError(
        "--model",
        f"unknown family {family!r}; expected one of {', '.join(FAMILIES)} or a local Hugging Face model directory",
    )


def _model_class(family: str):
    transformers = import_transformers()
    return transformers.DeepseekV3ForCausalLM if family == "deepseek" else transformers.LlamaForCausalLM


def _make_bidirectional(model: torch.nn.Module) -> int:
    """Clear `is_causal` on every attention module (sdpa/flash use it when the mask is None)."""
    n = 0
    for m in model.modules():
        if hasattr(m, "is_causal") and hasattr(m, "o_proj"):
            m.is_causal = False
            n += 1
    return n


# --- parameter counts --------------------------------------------------------------------


def _moe_shape(cfg: Any) -> tuple[int, int] | None:
    """(experts per token, routed experts) of an MoE config, else None."""
    k = getattr(cfg, "num_experts_per_tok", None)
    e = (
        getattr(cfg, "n_routed_experts", None)
        or getattr(cfg, "num_local_experts", None)
        or getattr(cfg, "num_experts", None)
    )
    return (int(k), int(e)) if k and e else None


def count_params(model: torch.nn.Module, cfg: Any) -> dict[str, int]:
    """Total, active-per-token and input-embedding parameters of a model.

    Active: routed expert weights (parameters under ``.mlp.experts.``) count
    ``top_k / n_experts`` of their size; everything else (attention, dense
    MLPs, shared experts, routers, norms, embeddings, head) counts fully.
    Tied parameters count once.
    """
    total = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".mlp.experts." in name:
            routed += p.numel()
    active = total
    moe = _moe_shape(cfg)
    if moe and routed:
        k, e = moe
        active = total - routed + routed * k // e
    emb = model.get_input_embeddings()
    embedding = emb.weight.numel() if emb is not None else 0
    return {"total": total, "active": active, "embedding": embedding}


def _attention_shape(cfg: Any) -> tuple[int, int, int, int]:
    """(layers, heads, qk head dim, v head dim) for the FLOPs formula."""
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    if getattr(cfg, "qk_nope_head_dim", None) is not None and getattr(cfg, "v_head_dim", None) is not None:
        qk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)  # MLA
        return layers, heads, qk, int(cfg.v_head_dim)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return layers, heads, int(hd), int(hd)


def training_flops_per_token(model: torch.nn.Module, cfg: Any, seq_len: int) -> int:
    """torchtitan's FLOPs per token for a built model (see trainer.flops), frozen weights counted at 4 not 6.

    N is split into the active non-embedding parameters that train (6 FLOPs each per token) and the
    frozen ones (a LoRA base: 4, no weight gradient), see `trainer.flops.flops_per_token`."""
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    # The input embedding is a lookup, not a matmul; the output head is a matmul.
    # With tied weights the one matrix is the head, so it stays in N.
    emb = model.get_input_embeddings()
    skip = None if tied or emb is None else emb.weight
    sums = {(t, r): 0 for t in (True, False) for r in (True, False)}  # (trains, routed expert) -> params
    for name, p in model.named_parameters():
        if p is skip:
            continue
        sums[(p.requires_grad, ".mlp.experts." in name)] += p.numel()
    moe = _moe_shape(cfg)

    def active(trains: bool) -> int:
        routed = sums[(trains, True)]
        return sums[(trains, False)] + (routed * moe[0] // moe[1] if moe and routed else routed)

    layers, heads, qk, v = _attention_shape(cfg)
    return _flops.flops_per_token(active(True), layers, heads, qk, seq_len, v_head_dim=v, frozen_params=active(False))


_COUNT_CACHE: dict[tuple[str, str, int], dict[str, int]] = {}


def param_counts(family: str, size: str, vocab_size: int = DEFAULT_VOCAB) -> dict[str, int]:
    """Parameter counts of a family/size without allocating it (built on the meta device)."""
    key = (family, size, vocab_size)
    if key not in _COUNT_CACHE:
        vocab, _ = vocab_and_mask(family, vocab_size, None)
        cfg = hf_config(family, size, vocab_size=vocab)
        with torch.device("meta"):
            model = _model_class(family)(cfg)
        _COUNT_CACHE[key] = count_params(model, cfg)
    return dict(_COUNT_CACHE[key])


# --- building -----------------------------------------------------------------------


def build_model(
    mcfg: ModelConfig,
    *,
    vocab_size: int,
    seq_len: int,
    toggles: Toggles,
    dev: DeviceInfo,
    mask_id: int | None = None,
    seed: int = 0,
    finetune: FinetuneConfig | None = None,
) -> ModelBundle:
    """Build the model of a run on the CPU in fp32; the trainer moves it to the device.

    `vocab_size` is the tokenizer's; the model's is padded. Initialization uses
    its own RNG seeded with `seed`, so it leaves the global RNG untouched and is
    the same whatever ran before. fp8 conversion is not done here (it needs the
    model on the GPU): see trainer.fp8. With `finetune.lora` the model is wrapped with LoRA adapters
    (trainer.lora) and only those train.
    """
    bundle = _build_base(
        mcfg,
        vocab_size=vocab_size,
        seq_len=seq_len,
        toggles=toggles,
        dev=dev,
        mask_id=mask_id,
        seed=seed,
        finetune=finetune,
    )
    if finetune is None or not finetune.enabled:
        return bundle
    from .lora import apply_lora

    model = apply_lora(bundle.model, finetune, seed, quantized=toggles.quantize_base != "none")
    bundle.model = model
    bundle.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counts = count_params(model, bundle.hf_config)  # base + adapters
    bundle.total_params, bundle.active_params = counts["total"], counts["active"]
    bundle.flops_per_token = training_flops_per_token(model, bundle.hf_config, seq_len)
    return bundle


def _build_base(
    mcfg: ModelConfig,
    *,
    vocab_size: int,
    seq_len: int,
    toggles: Toggles,
    dev: DeviceInfo,
    mask_id: int | None,
    seed: int,
    finetune: FinetuneConfig | None,
) -> ModelBundle:
    quantize = toggles.quantize_base if finetune is not None and finetune.enabled else "none"
    if is_pretrained_path(mcfg.model):
        return _load_pretrained(
            mcfg.model,
            vocab_size=vocab_size,
            seq_len=seq_len,
            toggles=toggles,
            mask_id=mask_id,
            quantize=quantize if quantize != "none" else None,
            dev=dev,
        )
    if quantize != "none":
        raise ConfigError(
            "--quantize-base",
            f"{quantize} quantizes pretrained weights; the family {mcfg.model} "
            f"starts from random ones. Fine-tune a model directory (--model DIR) "
            f"or drop --quantize-base",
        )
    family = mcfg.model
    if family not in FAMILIES:
        raise ConfigError(
            "--model",
            f"{family!r} is neither a family ({', '.join(FAMILIES)}) nor a local "
            "Hugging Face model directory (a folder with config.json)",
        )
    size = resolve_size(mcfg.size, family, dev)
    vocab, mask = vocab_and_mask(family, vocab_size, mask_id)
    cfg = hf_config(family, size, vocab_size=vocab, seq_len=seq_len, attention=toggles.attention)
    cls = _model_class(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    if family == "llada":
        _make_bidirectional(model)
        cfg.mask_token_id = mask  # saved with save_pretrained, so a llada export fine-tunes as llada
    model.to(torch.float32)
    _apply_toggles(model, toggles)
    counts = count_params(model, cfg)
    return ModelBundle(
        model=model,
        family=family,
        size=size,
        hf_config=cfg,
        vocab_size=vocab,
        total_params=counts["total"],
        active_params=counts["active"],
        embedding_params=counts["embedding"],
        flops_per_token=training_flops_per_token(model, cfg, seq_len),
        objective=OBJECTIVES[family],
        mask_id=mask,
    )


def _apply_toggles(model: torch.nn.Module, toggles: Toggles) -> None:
    """The toggles that live on the model: attention kernel and activation checkpointing."""
    if getattr(model.config, "_attn_implementation", None) != toggles.attention:
        model.set_attn_implementation(toggles.attention)
    # transformers 5 renamed gradient_* to activation_checkpointing_*; the old names warn.
    if toggles.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        if model.is_activation_checkpointing:
            model.activation_checkpointing_disable()
    elif model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()
    model.config.use_cache = False


def _load_pretrained(
    path: str,
    *,
    vocab_size: int,
    seq_len: int,
    toggles: Toggles,
    mask_id: int | None,
    quantize: str | None = None,
    dev: DeviceInfo | None = None,
) -> ModelBundle:
    """Fine-tune a local HF causal LM from its weights (no network); `quantize` (nf4, int8): a QLoRA base on `dev`."""
    transformers = import_transformers()
    extra: dict[str, Any] = {}
    if quantize is not None:
        from .lora import quantization_config

        # bitsandbytes quantizes while loading, on the GPU (see trainer.lora; documentation-verified only)
        extra = {
            "quantization_config": quantization_config(quantize, toggles.precision),
            "device_map": {"": str(dev.torch_device) if dev is not None else 0},
        }
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation=toggles.attention, **extra
        )
    except (OSError, ValueError) as e:
        raise ConfigError("--model", f"cannot load a causal LM from {path}: {e}") from None
    cfg = model.config
    objective, mask = "causal", None
    if getattr(cfg, "is_causal", True) is False:
        # A bidirectional model (a llada export): keep it bidirectional and train it as llada.
        _make_bidirectional(model)
        objective = "llada"
        # The model's own mask token (what it learned to fill in) wins over the data tokenizer's.
        mask = getattr(cfg, "mask_token_id", None)
        mask = mask_id if mask is None else int(mask)
        if mask is None:
            raise ConfigError(
                "--model",
                f"{path} is a bidirectional model without a mask_token_id in its config.json, and the data gives none",
            )
    if vocab_size > model.get_input_embeddings().weight.shape[0]:
        # The tokenizer knows more tokens than the model has rows: grow (new rows are initialized by HF).
        model.resize_token_embeddings(vocab_size, pad_to_multiple_of=VOCAB_MULTIPLE)
    if mask is not None and mask >= model.get_input_embeddings().weight.shape[0]:
        raise ConfigError("--model", f"mask id {mask} is outside the vocabulary of {path}")
    if quantize is None:
        model.to(torch.float32)
    _apply_toggles(model, toggles)
    counts = count_params(model, cfg)
    return ModelBundle(
        model=model,
        family="pretrained",
        size="pretrained",
        hf_config=cfg,
        vocab_size=model.get_input_embeddings().weight.shape[0],
        total_params=counts["total"],
        active_params=counts["active"],
        embedding_params=counts["embedding"],
        flops_per_token=training_flops_per_token(model, cfg, seq_len),
        objective=objective,
        mask_id=mask,
    )


def check_qlora(dev: Any, quick: bool) -> Any:
    """gptop doctor's `qlora` path: a tiny llama saved as a model directory, built the way a run with
    `--model DIR --lora 4 --quantize-base nf4` builds it (trainer.models.build_model: bitsandbytes' nf4
    base, peft adapters), moved to the device as the trainer does, one step under bf16 autocast: the loss
    is finite, the adapters change and the quantized base does not."""
    import tempfile

    from .contract.capabilities import support
    from .contract.doctor import Outcome

    reason = support("quantize_base", "nf4", dev)
    if reason:
        return Outcome.skip(reason)
    from transformers import LlamaForCausalLM

    device = dev.torch_device
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="gptop-doctor-qlora-") as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(hf_config("llama", "tiny", vocab_size=512, seq_len=64)).save_pretrained(tmp)
        toggles = Toggles(precision="bf16", quantize_base="nf4")
        bundle = build_model(
            ModelConfig(model=tmp),
            vocab_size=512,
            seq_len=64,
            toggles=toggles,
            dev=dev,
            finetune=FinetuneConfig(lora=4),
        )
        model = bundle.model.to(device)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 512, (2, 64), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    value = float(loss.detach())
    now = dict(model.named_parameters())
    adapters_moved = any(not torch.equal(v, now[n]) for n, v in trained.items())
    base_kept = all(torch.equal(v, now[n]) for n, v in frozen.items())
    quantized = sorted({type(m).__name__ for m in model.modules() if "4bit" in type(m).__name__})
    ok = math.isfinite(value) and adapters_moved and base_kept and bool(quantized)
    return Outcome.verdict(
        ok,
        f"base {', '.join(quantized) or 'NOT quantized'}; loss {value:.4g}; adapters "
        f"{'changed' if adapters_moved else 'unchanged'}, base "
        f"{'unchanged' if base_kept else 'CHANGED'}",
        "the nf4 base with LoRA adapters did not train as expected",
        loss=value,
    )
