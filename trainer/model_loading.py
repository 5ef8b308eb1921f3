"""A run's trained model loaded for inference (a checkpoint rebuilt as the trainer built it, or a model
directory), with its tokenizer as transformers sees it: what export and sample start from."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import checkpoint_files as ckpt
from .contract import tools
from .contract.config import ConfigError, FinetuneConfig, ModelConfig, TrainConfig, Toggles
from .contract.rundir import CheckpointInfo, RunDir
from .data import EOS, MASK, PAD, TokenizerInfo, data_fingerprint, tokenizer_info
from .models import ModelBundle, build_model, import_transformers, quiet_imports
from .process_costs import resume_gc

Log = Callable[[str], None]


class ExportError(RuntimeError):
    """The export cannot be made or would be wrong; the message says why and what to do."""


def stderr_log(prefix: str) -> Log:
    return lambda msg: print(f"{prefix}: {msg}", file=sys.stderr, flush=True)


# --- a checkpoint or a model directory ----------------------------------------------------------------------


@dataclass
class LoadedModel:
    """A trained model ready for inference, with the tokenizer its token ids come from."""

    model: torch.nn.Module  # eval mode, fp32
    bundle: ModelBundle
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    source: Path  # the checkpoint, or the model directory
    step: int | None  # the checkpoint's step (None for a model directory)
    cfg: TrainConfig | None  # the run's configuration (None for a model directory)

    @property
    def objective(self) -> str:
        return self.bundle.objective

    @property
    def mask_id(self) -> int | None:
        return self.bundle.mask_id


def load_for_inference(
    path: str | Path,
    candidates: list[CheckpointInfo] | None,
    *,
    step_given: bool = False,
    device: str = "cpu",
    log: Log = stderr_log("export"),  # noqa: B008  (one shared default logger)
) -> LoadedModel:
    """The model of a run's checkpoint (the first of `candidates` that loads), or of a model directory.

    Candidates come from `tools.check_export/check_sample`. A corrupt one is reported and the next
    tried; with `step_given` (the user chose it) it is an error naming --step instead."""
    from .device_probe import detect

    import_transformers()  # a tool's last heavy import, still without the GC's collections
    resume_gc()  # loading and checking the model may make garbage worth collecting
    dev = detect(device)
    if candidates is None:
        return _load_model_dir(Path(path), dev, log)
    errors = []
    for info in candidates:
        try:
            return _load_checkpoint(Path(path), info, dev, log)
        except (ckpt.CorruptCheckpoint, FileNotFoundError) as e:
            # FileNotFoundError: pruned by a live run while we read it; an older one may still be there
            if step_given:
                raise ConfigError("--step", f"the checkpoint of step {info.step} does not load: {e}") from None
            log(f"warning: skipping {info.path.name}: {e}")
            errors.append(str(e))
    raise ExportError(f"no checkpoint of {path} loads ({len(errors)} tried): {'; '.join(errors)}")


def _load_checkpoint(run_dir: Path, info: CheckpointInfo, dev: Any, log: Log) -> LoadedModel:
    kind = "sharded (DCP)" if info.sharded else "one-file"
    log(f"loading {info.path} (step {info.step}, {kind})")
    state = ckpt.load(info.path)  # a sharded checkpoint: its gptop.json only
    try:
        cfg = TrainConfig.from_dict(state["config"])
    except ConfigError as e:
        raise ckpt.CorruptCheckpoint(f"{info.path}: its config does not parse ({e})") from None
    tok = tokenizer_info(cfg.data, log=log)
    _check_tokenizer(run_dir, cfg, tok, log)
    if cfg.toggles.quantize_base != "none":
        raise ExportError(
            f"{info.path} was trained on a {cfg.toggles.quantize_base}-quantized base (QLoRA); "
            f"exporting it is not supported yet"
        )
    bundle = rebuild_model(cfg.model, tok, cfg, dev, info.path, finetune=cfg.finetune)
    model = bundle.model
    if info.sharded:  # a LoRA run's shards: the adapters (older ones also hold the base; only these load)
        if cfg.finetune.enabled:
            from .lora import trainable_state_dict

            tensors = {"model": trainable_state_dict(model)}
        else:
            tensors = {"model": model.state_dict()}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                ckpt.load_sharded(tensors, info.path)
        except Exception as e:  # a missing or truncated shard, a changed model
            raise ckpt.CorruptCheckpoint(f"{info.path}: the model shards do not load ({ckpt.brief(e)})") from e
        weights = tensors["model"]
    else:
        weights = state["model"]
    try:
        if cfg.finetune.enabled:  # a LoRA checkpoint holds the adapters
            from .lora import load_trainable_state

            load_trainable_state(model, weights)
        else:
            model.load_state_dict(weights)
    except RuntimeError as e:
        raise ckpt.CorruptCheckpoint(
            f"{info.path}: its weights do not fit the model {bundle.family}/{bundle.size} "
            f"rebuilt from its config ({ckpt.brief(e)})"
        ) from e
    del state, weights
    model.to(dev.torch_device).eval()
    return LoadedModel(
        model=model,
        bundle=bundle,
        tokenizer=hf_tokenizer(tok, bundle, cfg.data.seq_len),
        source=info.path,
        step=info.step,
        cfg=cfg,
    )


def rebuild_model(
    mcfg: ModelConfig,
    tok: TokenizerInfo,
    cfg: TrainConfig,
    dev: Any,
    where: Path,
    finetune: FinetuneConfig | None = None,
) -> ModelBundle:
    """The run's model, built by the trainer's own builder (fp32, sdpa, no activation checkpointing); with
    `finetune` (a LoRA run) wrapped with its adapters, as the trainer did."""
    try:
        with quiet_imports():
            return build_model(
                mcfg,
                vocab_size=tok.vocab_size,
                seq_len=cfg.data.seq_len,
                toggles=Toggles(),
                dev=dev,
                mask_id=tok.mask_id,
                seed=cfg.optim.seed,
                finetune=finetune,
            )
    except ConfigError as e:
        raise ExportError(
            f"cannot rebuild the model of {where} ({e}); a run that fine-tuned a model "
            "directory needs that directory for its architecture"
        ) from None


def _check_tokenizer(run_dir: Path, cfg: TrainConfig, tok: TokenizerInfo, log: Log) -> None:
    """Is `tok` the tokenizer the run trained with? Its hello event recorded the data fingerprint.

    The builtin tokenizer is rebuilt from this Python's stdlib and $GPTOP_BUILTIN_BYTES, so another
    environment can give another one: that would export a tokenizer whose ids mean other text."""
    recorded = _recorded_fingerprint(run_dir)
    if recorded is None:
        log("warning: the run has no hello event with a data fingerprint; the tokenizer cannot be checked")
        return
    try:
        now = data_fingerprint(cfg.data, tok)
    except ConfigError as e:
        log(f"warning: the tokenizer cannot be checked against the run's data ({e})")
        return
    if now == recorded:
        return
    what = (
        (
            f"the builtin tokenizer of this environment ({tok.path}) is not the one the run trained with: it is "
            "trained on this Python's standard library, capped by $GPTOP_BUILTIN_BYTES; export with the same "
            "Python and environment as the run"
        )
        if cfg.data.tokenizer is None and cfg.data.data == "builtin"
        else None
    )
    if what:
        raise ExportError(what)
    log(
        f"warning: the data or tokenizer ({cfg.data.data}, {tok.path}) changed since the run trained; the "
        "tokenizer written is this environment's"
    )


def _recorded_fingerprint(run_dir: Path) -> str | None:
    """The data fingerprint of the run's (last) hello event, if it has one."""
    from .contract.events import HelloEvent, read_events

    found = None
    try:
        for event in read_events(RunDir(run_dir).events(0)):
            if isinstance(event, HelloEvent):
                found = (event.data or {}).get("fingerprint") or found
    except OSError:
        return None
    return found


def _load_model_dir(path: Path, dev: Any, log: Log) -> LoadedModel:
    """An exported (or any local HF) model: gptop's own loader restores a llada export's objective and mask.
    An adapter export is its base (the export's own `base/`, or the model directory it names, checked against
    the fingerprint recorded at export: tools.adapter_base) with the adapter loaded by peft."""
    log(f"loading {path}")
    base = tools.adapter_base(path)
    with quiet_imports():
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises several types for a missing or bad tokenizer
            raise ConfigError(
                "RUN_DIR", f"{path} has no tokenizer transformers can load ({type(e).__name__}: {e})"
            ) from None
        mask = getattr(tokenizer, "mask_token_id", None)
        bundle = build_model(
            ModelConfig(model=str(base or path)),
            vocab_size=len(tokenizer),
            seq_len=2048,
            toggles=Toggles(),
            dev=dev,
            mask_id=mask,
        )
        if base is not None:
            from peft import PeftModel

            log(f"the LoRA adapter of {path} on its base {base}")
            bundle.model = PeftModel.from_pretrained(bundle.model, str(path))
    bundle.model.to(dev.torch_device).eval()
    return LoadedModel(model=bundle.model, bundle=bundle, tokenizer=tokenizer, source=path, step=None, cfg=None)


# --- the tokenizer as transformers sees it ------------------------------------------------------


def hf_tokenizer(tok: TokenizerInfo, bundle: ModelBundle, seq_len: int) -> Any:
    """The run's tokenizer as a transformers tokenizer with the run's special tokens.

    A directory given with --tokenizer (or the fine-tuned model's) is loaded with AutoTokenizer, keeping
    its own settings; otherwise the `tokenizers` BPE is wrapped in PreTrainedTokenizerFast. A llada
    model's mask id becomes the tokenizer's mask token (added as `<|mask|>` when the tokenizer had none
    and the model took the first free id for it)."""
    with quiet_imports():
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = None
    if isinstance(tok.tokenizer, Tokenizer):
        if Path(tok.path).is_dir():
            try:
                hf = AutoTokenizer.from_pretrained(tok.path, local_files_only=True)
            except Exception:  # no tokenizer_config.json transformers understands: wrap tokenizer.json below
                hf = None
            if hf is not None and len(hf) != tok.vocab_size:
                hf = None
        if hf is None:
            backend = tok.tokenizer
            names = {"eos_token": backend.id_to_token(tok.eos_id)}
            if backend.token_to_id(PAD) is not None:
                names["pad_token"] = PAD
            if tok.mask_id is not None:
                names["mask_token"] = backend.id_to_token(tok.mask_id)
            hf = PreTrainedTokenizerFast(tokenizer_object=backend, **names)
    else:
        hf = tok.tokenizer
    hf.model_max_length = seq_len  # the context the model was trained on
    if bundle.mask_id is not None and hf.mask_token_id != bundle.mask_id:
        existing = hf.convert_ids_to_tokens(bundle.mask_id) if bundle.mask_id < len(hf) else None
        if existing is not None:
            hf.add_special_tokens({"mask_token": existing})
        elif bundle.mask_id == len(hf):
            hf.add_special_tokens({"mask_token": MASK})
        if hf.mask_token_id != bundle.mask_id:
            raise ExportError(
                f"the model's mask id {bundle.mask_id} is not a token of the tokenizer {tok.path} ({len(hf)} tokens)"
            )
    return hf


def eos_id(tokenizer: Any) -> int | None:
    """The end-of-text id: documents are separated by it in training."""
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    i = tokenizer.convert_tokens_to_ids(EOS)
    return None if i is None or i == tokenizer.unk_token_id else i
