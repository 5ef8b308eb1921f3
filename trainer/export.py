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

The model is loaded by trainer.model_loading, as `python -m trainer.sample` loads it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import checkpoint_files as ckpt
from . import process_costs
from .contract import protect, tools
from .contract.config import ConfigError
from .data import tokenizer_info
from .models import ModelBundle, quiet_imports
from .model_loading import (
    ExportError,
    LoadedModel,
    Log,
    eos_id,
    hf_tokenizer as hf_tokenizer,
    load_for_inference,
    rebuild_model,
    stderr_log,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
CHECK_TOKENS = 64  # tokens per sequence of the logits check
CHECK_TEXT = "def main(argv):\n    return sorted(set(argv), key=len)\n"


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
    model, bundle = loaded.model, loaded.bundle
    base_dir, base_ref = _write_base(loaded, tmp, out, log)
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
    (tmp / "README.md").write_text(_adapter_readme(bundle, base_ref, out))
    log("reading it back with transformers and peft (PeftModel.from_pretrained) to check it")
    return {
        **_check_adapter(loaded, base_dir, tmp),
        "base": base_ref,
        "base_fingerprint": tools.base_fingerprint(base_dir),
    }


def _write_base(loaded: LoadedModel, tmp: Path, out: Path, log: Log) -> tuple[Path, str]:
    """Where the adapter's base is and how adapter_config.json names it: the model directory the run
    fine-tuned, or for a built-in family the run's initialization, rebuilt and written to OUT_DIR/base."""
    bundle, cfg = loaded.bundle, loaded.cfg
    if bundle.family == "pretrained":
        base_dir = Path(cfg.model.model).expanduser().resolve()
        return base_dir, str(base_dir)
    log(f"writing the base of {bundle.family}/{bundle.size} (the run's initialization) to {out / BASE_DIR}")
    tok = tokenizer_info(cfg.data, log=log)
    base = rebuild_model(cfg.model, tok, cfg, detect_cpu(), loaded.source).model
    trained = loaded.model.get_base_model()
    for key in BASE_CONFIG_KEYS:  # a llada base is bidirectional with its mask token, as the model
        if hasattr(trained.config, key):
            setattr(base.config, key, getattr(trained.config, key))
    base.generation_config = trained.generation_config
    with quiet_imports():
        base.save_pretrained(tmp / BASE_DIR)
        loaded.tokenizer.save_pretrained(tmp / BASE_DIR)
    return tmp / BASE_DIR, BASE_DIR


def _adapter_readme(bundle: ModelBundle, base_ref: str, out: Path) -> str:
    """The export's README.md: where its base is and how to load the adapter on it."""
    relative = bundle.family != "pretrained"
    return ADAPTER_README.format(
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


def _check_adapter(loaded: LoadedModel, base_dir: Path, tmp: Path) -> dict[str, Any]:
    """The written adapter, loaded on its base by plain transformers + peft, gives the checkpoint's logits."""
    model = loaded.model
    with quiet_imports():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        reloaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True, dtype=torch.float32), str(tmp)
        ).eval()
    ids = check_batch(len(loaded.tokenizer), loaded.bundle.mask_id, CHECK_TOKENS)
    with torch.no_grad():
        a = model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu()
        b = reloaded(input_ids=ids).logits
    diff = float((a - b).abs().max())
    if not diff <= 1e-5 * max(1.0, float(a.abs().max())):
        raise ExportError(
            f"the written adapter's logits differ from the checkpoint's by up to {diff:.3g}; "
            f"nothing was written to OUT_DIR"
        )
    return {"equal": bool(torch.equal(a, b)), "max_abs_diff": diff}


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
    sys.exit(process_costs.set_exit_code(main()))  # then no interpreter teardown
