"""Which setup a study is for: the readable key of what decides which toggles are fast, and the study's name.

A study is keyed by device name and type, compute capability, number of ranks, model family and size,
tokenizer, seq_len, global batch, what trains (LoRA), torch and transformers versions, and the search space.
The name is a hash of that key (plus the family and size for humans). The config passed in must be resolved
(`--size auto` already chosen).
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from trainer.contract.config import TrainConfig
from trainer.contract.device import DeviceInfo

from .space import SearchSpace

KEY_SCHEMA = 1


def library_versions() -> dict[str, str]:
    """torch and transformers versions (from package metadata: no import, no seconds spent)."""
    out = {}
    for name in ("torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def study_key(
    cfg: TrainConfig, dev: DeviceInfo, space: SearchSpace, world_size: int = 1, versions: dict[str, str] | None = None
) -> dict[str, Any]:
    """The readable key of the study for this hardware, model, shape, libraries and space."""
    return {
        "schema": KEY_SCHEMA,
        "device": dev.name,
        "device_type": dev.type,
        "capability": list(dev.capability) if dev.capability else None,
        "device_count": world_size,
        "model": cfg.model.model,
        "size": cfg.model.size,
        "tokenizer": cfg.data.tokenizer,
        "seq_len": cfg.data.seq_len,
        "global_batch": cfg.optim.global_batch,
        # what trains: a LoRA run's speed and memory are another problem than full training's
        "lora": [cfg.finetune.lora, cfg.finetune.lora_targets] if cfg.finetune.enabled else None,
        "versions": versions if versions is not None else library_versions(),
        "space": space.key(),
    }


def study_name(key: dict[str, Any]) -> str:
    """The study's name: the model family and size for humans, and a hash of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    family = re.sub(r"[^A-Za-z0-9]+", "-", Path(str(key.get("model", "model"))).name).strip("-") or "model"
    return f"gptop-{family}-{key.get('size', '')}-{digest}"
