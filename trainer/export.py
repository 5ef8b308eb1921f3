"""`python -m trainer.export RUN_DIR OUT_DIR`: a run's checkpoint as a Hugging Face model directory.

A run's model is a stock transformers architecture (trainer.models), so exporting is
rebuilding it exactly as the trainer did (`build_model` from the checkpoint's config and
the run's tokenizer), loading the checkpoint's weights (a one-file `.pt`, or a sharded
`.dcp/` read with torch.distributed.checkpoint in this one process: DCP reshards on
load and needs no process group), and `save_pretrained`: model.safetensors,
config.json, generation_config.json and the tokenizer files (tokenizer.json and
tokenizer_config.json, a `PreTrainedTokenizerFast` around the run's `tokenizers`
BPE). Plain transformers loads the result with `AutoModelForCausalLM` and
`AutoTokenizer`, without gptop.

A llada export keeps what makes it llada in config.json: ``is_causal: false``
(transformers 5 reads it and attends bidirectionally; `_load_pretrained` in
trainer.models then trains it with the llada objective) and ``mask_token_id``, which
is also the tokenizer's mask token. Every export also records ``gptop`` provenance
(family, size, objective, step, run) in config.json.

The directory is written under a temporary name next to OUT_DIR, read back with
`from_pretrained` and checked against the checkpoint (same logits on a batch, same
token ids for a text), then renamed into place: an interrupted export leaves OUT_DIR
as it was, and the next export into it removes what a killed one left. What OUT_DIR
may be (new, empty, or with --force an earlier export, never a run or anything else)
is trainer.contract.protect's one rule; the export's `gptop-export.json` lists the
files it wrote, so a later --force recognizes it.

`load_for_inference` is also what `python -m trainer.sample` loads a model with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import checkpoint_files as ckpt
from .contract import protect, tools
from .contract.config import ConfigError, FinetuneConfig, ModelConfig, TrainConfig, Toggles
from .contract.rundir import CheckpointInfo, RunDir
from .data import EOS, MASK, PAD, TokenizerInfo, data_fingerprint, tokenizer_info
from .models import ModelBundle, build_model, quiet_imports

Log = Callable[[str], None]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
CHECK_TOKENS = 64  # tokens per sequence of the logits check
CHECK_TEXT = "def main(argv):\n    return sorted(set(argv), key=len)\n"


class ExportError(RuntimeError):
    """The export cannot be made or would be wrong; the message says why and what to do."""


def stderr_log(prefix: str) -> Log:
    return lambda msg: print(f"{prefix}: {msg}", file=sys.stderr, flush=True)


# --- loading a run's model ----------------------------------------------------------------------


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
    bundle = _build(cfg.model, tok, cfg, dev, info.path, finetune=cfg.finetune)
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


def _build(
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


# --- export -------------------------------------------------------------------------------------


def export(ns: argparse.Namespace, log: Log = stderr_log("export")) -> dict[str, Any]:  # noqa: B008  (shared logger)
    """Write OUT_DIR from RUN_DIR's checkpoint (see the module docstring); returns the result fields."""
    t0 = time.monotonic()
    candidates = tools.check_export(ns)
    loaded = load_for_inference(ns.run_dir, candidates, step_given=ns.step is not None, log=log)
    model, bundle, tokenizer = loaded.model, loaded.bundle, loaded.tokenizer
    lora = loaded.cfg is not None and loaded.cfg.finetune.enabled
    merge = bool(getattr(ns, "merge", False))
    if merge and not lora:
        raise ConfigError(
            "--merge",
            f"{ns.run_dir} trained every weight (no --lora), so there is no adapter to "
            f"merge; its export is already a full model: drop --merge",
        )
    adapter_logits = None
    if lora:
        ids = check_batch(len(tokenizer), bundle.mask_id, CHECK_TOKENS)
        with torch.no_grad():
            adapter_logits = model(input_ids=ids).logits.cpu()
        if merge:
            log("merging the adapters into the base (peft merge_and_unload)")
            model = loaded.model = bundle.model = model.merge_and_unload()
            merged = _logits_diff(model, ids, adapter_logits)
            if not merged <= 1e-4 * max(1.0, float(adapter_logits.abs().max())):
                raise ExportError(f"the merged model's logits differ from the adapted model's by {merged:.3g}")
    _prepare_config(loaded, Path(ns.run_dir))
    out = protect.resolve(ns.out_dir)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for gone in protect.remove_stale(out):
            log(f"removed {gone.name}, left next to {out.name} by an export that was killed")
        tmp = protect.make_temp_dir(out)
    except OSError as e:
        raise ConfigError("OUT_DIR", f"cannot write next to {out} ({e.strerror or e})") from None
    fmt = "merged" if merge else "peft-adapter" if lora else "model"
    try:
        if lora and not merge:
            check = _write_adapter(loaded, tmp, out, log)
        else:
            log(f"writing {bundle.family}/{bundle.size} ({bundle.total_params / 1e6:.1f}M params) to {out}")
            with quiet_imports():
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            log("reading it back with transformers (AutoModelForCausalLM, AutoTokenizer) to check it")
            check = check_export_dir(tmp, model, tokenizer, bundle)
        protect.write_marker(
            tmp,
            run=str(Path(ns.run_dir).resolve()),
            checkpoint=str(loaded.source),
            step=loaded.step,
            format=fmt,
            family=bundle.family,
            size=bundle.size,
            **{k: check[k] for k in ("base", "base_fingerprint") if k in check},
        )
        _usual_permissions(tmp)
        protect.replace_dir(tmp, out, "OUT_DIR", force=ns.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in out.iterdir())
    result = {
        "out_dir": str(out),
        "run_dir": str(ns.run_dir),
        "checkpoint": str(loaded.source),
        "step": loaded.step,
        "family": bundle.family,
        "size": bundle.size,
        "objective": bundle.objective,
        "mask_token_id": bundle.mask_id,
        "params": bundle.total_params,
        "files": files,
        "logits_max_abs_diff": check["max_abs_diff"],
        "logits_equal": check["equal"],
        "seconds": round(time.monotonic() - t0, 3),
        "format": fmt,
    }
    if lora and not merge:
        result["base_model"] = check["base"]
    return result


def _logits_diff(model: torch.nn.Module, ids: torch.Tensor, want: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu() - want).abs().max())


BASE_DIR = tools.ADAPTER_BASE_DIR
BASE_CONFIG_KEYS = ("is_causal", "mask_token_id", "use_cache", "gptop")  # what _prepare_config says of the model
ADAPTER_README = """\
# A LoRA adapter exported by gptop

`adapter_config.json` and `adapter_model.safetensors` are the adapter in peft's format; the tokenizer
files are the run's. The frozen base the adapter was trained on is {base_words}.

Load it with transformers and peft:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

export = "{example}"                          # this directory, wherever it is now
base = AutoModelForCausalLM.from_pretrained({base_expr})
model = PeftModel.from_pretrained(base, export)
tokenizer = AutoTokenizer.from_pretrained(export)
```

{relative}`gptop sample` takes this directory too; it checks that the base it finds is the one the adapter was
trained on (`base_fingerprint` in `gptop-export.json`) and refuses another.
"""


def _write_adapter(loaded: LoadedModel, tmp: Path, out: Path, log: Log) -> dict[str, Any]:
    """A LoRA run's adapter in peft's format (adapter_config.json, adapter_model.safetensors), the tokenizer
    and a README.md saying how to load it.

    `base_model_name_or_path` names the base: the model directory the run fine-tuned (absolute: it lies
    outside the export), or for a built-in family, whose base exists only as the run's seeded initialization,
    `base`: the copy in OUT_DIR/base, relative, so a copied or moved export keeps its own base (peft and
    transformers resolve it against the working directory: from elsewhere, load OUT_DIR/base as the README
    says). The base's fingerprint goes into gptop-export.json, so gptop never binds the adapter to another
    base. Read back with plain transformers + `peft.PeftModel.from_pretrained` and compared."""
    model, bundle, cfg = loaded.model, loaded.bundle, loaded.cfg
    if bundle.family == "pretrained":
        base_dir = Path(cfg.model.model).expanduser().resolve()
        base_ref = str(base_dir)
    else:
        base_dir, base_ref = tmp / BASE_DIR, BASE_DIR
        log(f"writing the base of {bundle.family}/{bundle.size} (the run's initialization) to {out / BASE_DIR}")
        tok = tokenizer_info(cfg.data, log=log)
        base = _build(cfg.model, tok, cfg, detect_cpu(), loaded.source).model
        trained = model.get_base_model()
        for key in BASE_CONFIG_KEYS:  # a llada base is bidirectional with its mask token, as the model
            if hasattr(trained.config, key):
                setattr(base.config, key, getattr(trained.config, key))
        base.generation_config = trained.generation_config
        with quiet_imports():
            base.save_pretrained(base_dir)
            loaded.tokenizer.save_pretrained(base_dir)
    # saved naming the base where it is now (peft reads its config.json to see whether the vocabulary grew)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) or bundle.trainable_params
    log(
        f"writing the LoRA adapter ({(bundle.trainable_params or trainable) / 1e6:.2f}M params, base {base_ref}) "
        f"to {out}"
    )
    with quiet_imports():
        model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
    config_path = tmp / "adapter_config.json"
    adapter_config = json.loads(config_path.read_text())
    adapter_config["base_model_name_or_path"] = base_ref
    config_path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    relative = bundle.family != "pretrained"
    (tmp / "README.md").write_text(
        ADAPTER_README.format(
            base_words=f"in `{BASE_DIR}/` here (the run's seeded initialization of {bundle.family} {bundle.size})"
            if relative
            else f"the model directory `{base_ref}`",
            example=str(out),
            base_expr=f'export + "/{BASE_DIR}"' if relative else repr(base_ref),
            relative=(
                "`adapter_config.json` names the base as `base`, relative: peft's AutoPeftModelForCausalLM "
                "resolves that against the working directory, so it loads the export from inside it "
                '(`AutoPeftModelForCausalLM.from_pretrained(".")`) and refuses it from elsewhere; the lines '
                "above work from anywhere.\n\n"
            )
            if relative
            else "",
        )
    )
    log("reading it back with transformers and peft (PeftModel.from_pretrained) to check it")
    with quiet_imports():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        reloaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True, dtype=torch.float32), str(tmp)
        ).eval()
    ids = check_batch(len(loaded.tokenizer), bundle.mask_id, CHECK_TOKENS)
    with torch.no_grad():
        a = model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu()
        b = reloaded(input_ids=ids).logits
    diff = float((a - b).abs().max())
    if not diff <= 1e-5 * max(1.0, float(a.abs().max())):
        raise ExportError(
            f"the written adapter's logits differ from the checkpoint's by up to {diff:.3g}; "
            f"nothing was written to OUT_DIR"
        )
    return {
        "equal": bool(torch.equal(a, b)),
        "max_abs_diff": diff,
        "base": base_ref,
        "base_fingerprint": tools.base_fingerprint(base_dir),
    }


def detect_cpu() -> Any:
    from .device_probe import detect

    return detect("cpu")


def _prepare_config(loaded: LoadedModel, run_dir: Path) -> None:
    """What config.json and generation_config.json should say for someone loading the export."""
    model, bundle, tokenizer = loaded.model, loaded.bundle, loaded.tokenizer
    cfg = model.config
    cfg.gptop = {
        "family": bundle.family,
        "size": bundle.size,
        "objective": bundle.objective,
        "step": loaded.step,
        "seq_len": loaded.cfg.data.seq_len if loaded.cfg else None,
        "run": run_dir.name,
    }
    if bundle.objective == "llada":
        cfg.is_causal = False  # transformers 5 attends bidirectionally; gptop trains it as llada
        cfg.mask_token_id = bundle.mask_id
        cfg.use_cache = False  # no KV cache for a bidirectional model
        return
    cfg.use_cache = True  # trained without it; generation wants it
    gen = model.generation_config
    eos = eos_id(tokenizer)
    if gen.eos_token_id is None and eos is not None:
        gen.eos_token_id = eos
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    gen.use_cache = True


def check_export_dir(path: Path, model: torch.nn.Module, tokenizer: Any, bundle: ModelBundle) -> dict[str, Any]:
    """Load `path` as plain transformers does and compare it with the checkpoint's model.

    Logits on a batch must agree to fp32 tolerance (they are normally bit-identical: the same class,
    the same fp32 weights, the same kernels); token ids of a text must be identical."""
    with quiet_imports():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        reloaded = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
        retok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    reloaded.eval()
    ids = check_batch(len(tokenizer), bundle.mask_id, CHECK_TOKENS)
    with torch.no_grad():
        a = model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu()
        b = reloaded(input_ids=ids).logits
    diff = float((a - b).abs().max())
    scale = float(a.abs().max())
    if not diff <= 1e-5 * max(1.0, scale):
        raise ExportError(
            f"the written model's logits differ from the checkpoint's by up to {diff:.3g} "
            f"(logits up to {scale:.3g}); nothing was written to OUT_DIR"
        )
    want = tokenizer(CHECK_TEXT, add_special_tokens=False)["input_ids"]
    got = retok(CHECK_TEXT, add_special_tokens=False)["input_ids"]
    if want != got:
        raise ExportError("the written tokenizer encodes text differently from the run's; nothing was written")
    if bundle.mask_id is not None and retok.mask_token_id != bundle.mask_id:
        raise ExportError(
            f"the written tokenizer's mask token is {retok.mask_token_id}, the model's "
            f"{bundle.mask_id}; nothing was written"
        )
    return {"equal": bool(torch.equal(a, b)), "max_abs_diff": diff}


def check_batch(vocab: int, mask_id: int | None, length: int, seed: int = 0) -> torch.Tensor:
    """Two sequences of token ids below `vocab` (about half masked for a llada model): a logits test batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, length), generator=g)
    if mask_id is not None:
        ids[torch.rand(2, length, generator=g) < 0.5] = mask_id
    return ids


def _usual_permissions(path: Path) -> None:
    """What a plain write under the umask gives (mkdtemp makes 0700, safetensors may write 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for f in path.rglob("*"):  # a LoRA export of a built-in family has base/ inside
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)


# --- command line -------------------------------------------------------------------------------


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def tool_main(name: str, work: Callable[[], int]) -> int:
    """Exit codes and messages shared by the tools: 0 done, 1 failed, 2 bad input, 130 interrupted."""
    from .dist import die_with_parent

    die_with_parent()  # started by gptop: never outlive it
    with quiet_imports():
        from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the tool's own progress lines say what happens
    for s in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C: clean up (the temporary directory) and exit
        signal.signal(s, _interrupt)
    try:
        return work()
    except ConfigError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ExportError, ckpt.CorruptCheckpoint, TimeoutError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.export", description="Write a run's checkpoint as a Hugging Face model directory."
    )
    tools.add_export_arguments(parser)
    ns = parser.parse_args(argv)

    def work() -> int:
        result = export(ns)
        if ns.json:
            print(tools.result_line("export", **result), flush=True)
        else:
            same = "bit-identical" if result["logits_equal"] else f"max |diff| {result['logits_max_abs_diff']:.2g}"
            print(
                f"exported step {result['step']} of {ns.run_dir} to {result['out_dir']} ({result['family']}, "
                f"{result['params'] / 1e6:.1f}M params; logits read back {same}) in {result['seconds']:.1f} s",
                flush=True,
            )
        return EXIT_OK

    return tool_main("export", work)


if __name__ == "__main__":
    sys.exit(main())
