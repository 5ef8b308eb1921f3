"""The tuner's toggles as `transformers.TrainingArguments` fields: the one mapping, both ways.

`gptop tune -- CMD` tunes a `transformers.Trainer` script with the tuner of gptop's own trainer: the same
`Toggles`, search space, study, measurement, ledger and decision. What differs is how a trial's toggles reach
the process: gptop hands them down (trainer.contract.client.ClientEnv.toggles) and the script's
`tuned_args(args)` turns them into the fields below. This module is that translation; it imports neither
torch nor transformers, so gptop's side (the search space) and the client's side (`tuned_args`) share it.

    toggle                    TrainingArguments fields
    precision                 bf16, fp16, tf32 (fp32: none of them, and tf32=False for a compiled model)
    compile                   torch_compile, torch_compile_mode (off also clears torch_compile_backend)
    micro_batch               per_device_train_batch_size, and gradient_accumulation_steps so that
                              per_device_train_batch_size x gradient_accumulation_steps (the per-device
                              batch of an optimizer step, hence the global batch) stays the script's own
    workers                   dataloader_num_workers
    prefetch                  dataloader_prefetch_factor (batches each worker loads ahead; only with workers)
    fused_adamw               optim: adamw_torch / adamw_torch_fused (only when the script uses one of them)
    activation_checkpointing  activation_checkpointing (transformers 5; there `gradient_checkpointing` is a
                              deprecated alias that only mirrors it, so setting it on a copy does nothing),
                              else gradient_checkpointing

The other toggles are frozen at the script's own values for a command: `attention` (the model's
`attn_implementation`, not an argument), `cuda_allocator` (an environment variable), `optimizer` (another
optimizer's state cannot be loaded from the checkpoint the Trainer resumes from) and `quantize_base`.
`dataloader_pin_memory` has no toggle (gptop's own trainer always pins on CUDA), so it stays the script's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config_schema import Toggles

# Which TrainingArguments fields each tuned toggle sets (docs/your-code.md lists the same).
TOGGLE_FIELDS: dict[str, tuple[str, ...]] = {
    "precision": ("bf16", "fp16", "tf32"),
    "compile": ("torch_compile", "torch_compile_mode", "torch_compile_backend"),
    "micro_batch": ("per_device_train_batch_size", "gradient_accumulation_steps"),
    "workers": ("dataloader_num_workers",),
    "prefetch": ("dataloader_prefetch_factor",),
    "fused_adamw": ("optim",),
    "activation_checkpointing": ("activation_checkpointing", "gradient_checkpointing"),
}
FIELDS: tuple[str, ...] = tuple(dict.fromkeys(f for fs in TOGGLE_FIELDS.values() for f in fs))
TUNED: tuple[str, ...] = tuple(TOGGLE_FIELDS)
# Toggles a command's tuning leaves at the script's values (the module doc says why).
FROZEN: tuple[str, ...] = ("attention", "cuda_allocator", "optimizer", "quantize_base")
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
ADAMW: dict[str, bool] = {"adamw_torch": False, "adamw_torch_fused": True}  # optim -> fused_adamw
# TrainingArguments.optim -> Toggles.optimizer, for the record (the toggle is frozen for a command)
OPTIMIZER_OF: dict[str, str] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_torch_8bit": "adamw-8bit",
    "adamw_torch_4bit": "adamw-4bit",
    "adafactor": "adafactor",
}
TORCH_PREFETCH = 2  # torch.utils.data.DataLoader's prefetch_factor when a worker runs and none is given
COMMAND_PREFETCH: tuple[int, ...] = (1, 2, 4)  # 0 means nothing to a DataLoader: prefetching needs a worker


def read_fields(args: Any) -> dict[str, Any]:
    """The fields of `args` (a TrainingArguments, or anything with those attributes) the mapping reads, with
    enums as their values (`optim` is an OptimizerNames)."""
    out = {}
    for name in FIELDS:
        v = getattr(args, name, None)
        out[name] = getattr(v, "value", v)
    return out


def optim_name(fields: Mapping[str, Any]) -> str:
    v = fields.get("optim")
    return str(getattr(v, "value", v))


def precision_of(fields: Mapping[str, Any], tf32_on: bool = False) -> str:
    """The precision the fields train in; `tf32_on`: the process's fp32 matmuls use TF32 although no field
    asked (TrainingArguments turns TF32 on for a compiled fp32 model on a GPU that has it), so fp32 is tf32."""
    if fields.get("bf16"):
        return "bf16"
    if fields.get("fp16"):
        return "fp16"
    return "tf32" if fields.get("tf32") or tf32_on else "fp32"


def tunable(fields: Mapping[str, Any]) -> list[str]:
    """The toggles a script with these arguments can take: every tuned one, but `fused_adamw` only when its
    optimizer is torch's AdamW (fused or not)."""
    return [n for n in TUNED if n != "fused_adamw" or optim_name(fields) in ADAMW]


def start_toggles(fields: Mapping[str, Any], tf32_on: bool = False) -> Toggles:
    """The script's own arguments as the tuner's starting Toggles (the frozen ones as near as they map);
    `tf32_on`: as `precision_of`'s."""
    mode = fields.get("torch_compile_mode")
    compiled = bool(fields.get("torch_compile")) or mode is not None or fields.get("torch_compile_backend") is not None
    factor = fields.get("dataloader_prefetch_factor")
    optim = optim_name(fields)
    return Toggles(
        precision=precision_of(fields, tf32_on),
        compile=(mode or "default") if compiled else "off",
        micro_batch=int(fields.get("per_device_train_batch_size") or 1),
        prefetch=int(factor) if factor else TORCH_PREFETCH,
        workers=int(fields.get("dataloader_num_workers") or 0),
        fused_adamw=ADAMW.get(optim, True),
        activation_checkpointing=bool(fields.get(checkpointing_field(fields))),
        optimizer=OPTIMIZER_OF.get(optim, "adamw"),
    )


def checkpointing_field(fields: Mapping[str, Any]) -> str:
    """The field that turns activation checkpointing on for these arguments: `activation_checkpointing` where
    the installed transformers has it (resolved to a bool in `__post_init__`), else `gradient_checkpointing`."""
    return (
        "activation_checkpointing" if fields.get("activation_checkpointing") is not None else "gradient_checkpointing"
    )


def per_device_batch(fields: Mapping[str, Any]) -> int:
    """Sequences one device trains per optimizer step: what every micro-batch must divide."""
    return int(fields.get("per_device_train_batch_size") or 1) * int(fields.get("gradient_accumulation_steps") or 1)


def args_fields(toggles: Toggles, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainingArguments fields to change so that a script whose own arguments are `fields` runs with
    `toggles` (only the ones that differ). ValueError when `toggles` ask for what a script cannot be given:
    a micro-batch that does not divide its per-device batch, a precision or compile mode no field holds, a
    fused_adamw change for another optimizer, or a frozen toggle away from the script's value."""
    start = start_toggles(fields)
    for name in FROZEN:
        if getattr(toggles, name) != getattr(start, name):
            raise ValueError(
                f"{name}={getattr(toggles, name)}: not a TrainingArguments field gptop changes "
                f"(the script has {getattr(start, name)})"
            )
    want: dict[str, Any] = {}
    p = toggles.precision
    if p not in PRECISIONS:
        raise ValueError(f"precision={p}: TrainingArguments has no field for it (one of {', '.join(PRECISIONS)})")
    want["bf16"], want["fp16"] = p == "bf16", p == "fp16"
    if p == "tf32":
        want["tf32"] = True
    elif p == "fp32" and (fields.get("tf32") or (fields.get("tf32") is None and toggles.compile != "off")):
        # fp32 means fp32 matmuls: TrainingArguments would turn TF32 on for a compiled fp32 model unless told
        # not to; bf16/fp16 keep the script's tf32
        want["tf32"] = False
    if toggles.compile == "off":
        want.update(torch_compile=False, torch_compile_mode=None, torch_compile_backend=None)
    else:
        want.update(torch_compile=True, torch_compile_mode=None if toggles.compile == "default" else toggles.compile)
    per_device = per_device_batch(fields)
    mb = toggles.micro_batch_int()
    if mb is None or per_device % mb:
        raise ValueError(
            f"micro_batch={toggles.micro_batch} does not divide the per-device batch {per_device} "
            f"(per_device_train_batch_size x gradient_accumulation_steps, kept fixed)"
        )
    want.update(per_device_train_batch_size=mb, gradient_accumulation_steps=per_device // mb)
    want["dataloader_num_workers"] = toggles.workers
    want["dataloader_prefetch_factor"] = toggles.prefetch if toggles.workers > 0 and toggles.prefetch > 0 else None
    if optim_name(fields) in ADAMW:
        want["optim"] = "adamw_torch_fused" if toggles.fused_adamw else "adamw_torch"
    elif toggles.fused_adamw != start.fused_adamw:
        raise ValueError(f"fused_adamw: the script's optimizer is {optim_name(fields)}, not adamw_torch(_fused)")
    want[checkpointing_field(fields)] = toggles.activation_checkpointing
    return {k: v for k, v in want.items() if fields.get(k) != v}


def start_fields(start: Toggles, per_device: int) -> dict[str, Any]:
    """The TrainingArguments fields a script runs `start` with, as far as its hello tells (the inverse of
    `start_toggles`; `per_device`: its per_device_train_batch_size x gradient_accumulation_steps): what
    `args_fields` weighs another setting against when the script's own arguments are not at hand."""
    mb = start.micro_batch_int() or 1
    optimizer = next((k for k, v in OPTIMIZER_OF.items() if v == start.optimizer), "adamw_torch")
    return {
        "bf16": start.precision == "bf16",
        "fp16": start.precision == "fp16",
        "tf32": True if start.precision == "tf32" else None,  # unset as in most scripts: a compile may turn it on
        "torch_compile": start.compile != "off",
        "torch_compile_mode": None if start.compile in ("off", "default") else start.compile,
        "torch_compile_backend": None,
        "per_device_train_batch_size": mb,
        "gradient_accumulation_steps": max(per_device // mb, 1),
        "dataloader_num_workers": start.workers,
        "dataloader_prefetch_factor": start.prefetch if start.workers > 0 else None,
        "optim": ("adamw_torch_fused" if start.fused_adamw else "adamw_torch")
        if start.optimizer == "adamw"
        else optimizer,
        "gradient_checkpointing": start.activation_checkpointing,
    }


def fields_in_words(toggles: Toggles, start: Toggles, per_device: int) -> str | None:
    """The TrainingArguments a script that started with `start` sets to run with `toggles`: 'bf16=True,
    per_device_train_batch_size=4, gradient_accumulation_steps=4' ('' when nothing changes); None when the
    toggles cannot be given as fields (`args_fields`' ValueError)."""
    try:
        change = args_fields(toggles, start_fields(start, per_device))
    except ValueError:
        return None
    return ", ".join(f"{k}={v!r}" for k, v in change.items())
