"""LoRA fine-tuning through peft: adapters on a frozen base, and what a checkpoint keeps of them.

`--lora R` wraps the run's model (a built-in family or a local Hugging Face model directory) with
peft's `get_peft_model` and a `LoraConfig` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models", arXiv:2106.09685): every targeted linear layer W gets a trainable update
(alpha / R) * B A with A (R x in) and B (out x R), B starting at zero, and every base weight is frozen
(`requires_grad=False`). The adapters are initialized from the run's seed in a forked RNG, so a
rebuilt model (resume, rollback, export) gets the same adapters whatever ran before.

Targets (`--lora-targets auto`): the attention and MLP projections the architecture has, by their
module names (`DEFAULT_TARGETS`): q/k/v/o and gate/up/down for llama-like models; deepseek's MLA
projections (q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj) and, for the MLP names, what peft (0.21
with transformers 5, as installed) makes of them on a model with fused experts: adapters on DeepSeek's
fused routed-expert tensors (gate_up_proj at rank 2R), none on its dense and shared-expert MLPs
(trainer.contract.estimate counts the same; tests/test_estimate.py checks it on the built model). The
output head and the embeddings are never targets.

A checkpoint of a LoRA run holds only the trainable tensors (`trainable_state_dict`) and their optimizer
state: the frozen base is rebuilt from where it came from (the model directory, or the family's seeded
initialization), which `check_compatible` in trainer.checkpointer makes sure is the same.

`--quantize-base nf4|int8` (QLoRA, Dettmers et al. 2023, arXiv:2305.14314) loads a model directory's
base through transformers' `BitsAndBytesConfig` (nf4 with double quantization, or LLM.int8()) and
`peft.prepare_model_for_kbit_training`. It is gated to CUDA in trainer.contract.capabilities and was
written against the transformers, peft and bitsandbytes documentation only: no GPU was available to
run it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .contract.config import (
    AUTO,
    LORA_ATTENTION_TARGETS,
    LORA_DEFAULT_TARGETS,
    LORA_MLP_TARGETS,
    ConfigError,
    FinetuneConfig,
)

# Module names that get adapters with `--lora-targets auto` (one list, in the torch-free contract: the memory
# estimate applies the same rule).
ATTENTION_TARGETS, MLP_TARGETS, DEFAULT_TARGETS = LORA_ATTENTION_TARGETS, LORA_MLP_TARGETS, LORA_DEFAULT_TARGETS


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name part of every linear layer (what peft's `target_modules` matches), sorted."""
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt", "Conv1D"):
            out.add(name.rsplit(".", 1)[-1])
    return sorted(out)


NEVER_TARGETS = ("lm_head",)  # the output head (and the embeddings, no linear layers) keep their weights


def targets(model: torch.nn.Module, fcfg: FinetuneConfig) -> list[str]:
    """The module names that get adapters; ConfigError naming --lora-targets when none would or one is not
    there, or --lora when the rank is above the smallest dimension of a layer it adapts (the rule
    trainer.contract.model_shapes.check_lora applies to the families before anything is built)."""
    present = [n for n in linear_names(model) if n not in NEVER_TARGETS]
    if fcfg.lora_targets == AUTO:
        chosen = [n for n in DEFAULT_TARGETS if n in present]
        if not chosen:
            raise ConfigError(
                "--lora-targets",
                f"auto knows no attention or MLP projection of this architecture; "
                f"name its linear layers, e.g. --lora-targets {','.join(present)}",
            )
    else:
        chosen = fcfg.lora_targets.split(",")
        missing = [n for n in chosen if n not in present]
        if missing:
            head = " (the output head is never adapted)" if any(n in NEVER_TARGETS for n in missing) else ""
            raise ConfigError(
                "--lora-targets",
                f"{','.join(missing)}: no layer of that name to adapt in this "
                f"model{head}; what can be targeted: {','.join(present)}",
            )
    dims = [
        (min(m.in_features, m.out_features), name.rsplit(".", 1)[-1], m.out_features, m.in_features)
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in chosen
        and isinstance(getattr(m, "in_features", None), int)
        and isinstance(getattr(m, "out_features", None), int)
    ]
    if dims and fcfg.lora > min(dims)[0]:
        limit, name, rows, cols = min(dims)
        raise ConfigError(
            "--lora",
            f"{fcfg.lora} is above {limit}, the smallest dimension of the layers it adapts "
            f"({name} is {rows}x{cols}): such an adapter is no low-rank update and has more "
            f"parameters than the layer; use --lora {limit} or less",
        )
    return chosen


def lora_config(model: torch.nn.Module, fcfg: FinetuneConfig) -> Any:
    """peft's LoraConfig of a run."""
    from peft import LoraConfig

    return LoraConfig(
        r=fcfg.lora,
        lora_alpha=fcfg.lora_alpha,
        lora_dropout=fcfg.lora_dropout,
        target_modules=targets(model, fcfg),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, fcfg: FinetuneConfig, seed: int, quantized: bool = False) -> torch.nn.Module:
    """`model` wrapped by peft with adapters (seeded from `seed`); only the adapters require gradients.
    `quantized`: the base was loaded quantized (`--quantize-base`), prepared for k-bit training first."""
    from peft import get_peft_model

    config = lora_config(model, fcfg)
    if quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed ^ 0x10A)
        wrapped = get_peft_model(model, config)
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # adapters train in fp32 (autocast still runs the matmuls in bf16)
    return wrapped


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of the state dict that train (the adapters), detached: what a LoRA checkpoint holds."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a LoRA checkpoint's tensors; every trainable tensor must be in it and nothing else."""
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    extra, missing = set(state) - want, want - set(state)
    if extra or missing:
        raise RuntimeError(
            f"the checkpoint's adapters do not match this model's (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(extra)[:3]}); was it trained with other --lora options?"
        )
    model.load_state_dict(state, strict=False)


def quantization_config(quantize: str, precision: str) -> Any:
    """transformers' BitsAndBytesConfig for `--quantize-base` (the compute dtype follows --precision)."""
    from transformers import BitsAndBytesConfig

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if quantize == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute
        )
    return BitsAndBytesConfig(load_in_8bit=True)
