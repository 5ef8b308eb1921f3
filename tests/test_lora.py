"""Fine-tuning in small memory: LoRA adapters on a frozen base, the optimizer choices, QLoRA's gate,
honest FLOPs with frozen weights, and the adapter / merged exports."""

import time
from pathlib import Path

import pytest
import torch

from helpers import TINY, of, restoring_signals, run_without_gptop, tiny_model_dir, train_in_process
from trainer import checkpoint_files as ckpt
from trainer.worker_cli import parse_config
from trainer.contract import capabilities, rundir
from trainer.contract.config import ConfigError, FinetuneConfig, ModelConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import read_events
from trainer.train import EXIT_CONFIG, EXIT_OK, Trainer

CPU = DeviceInfo(type="cpu", name="test cpu", total_memory=8 << 30, cpu_count=2)
H100 = DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3", total_memory=80 << 30, capability=(9, 0))
LORA = ["--lora", "8", "--lr", "1e-2", "--micro-batch", "2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Hugging Face model directory (llama tiny, random weights) with the builtin tokenizer."""
    return tiny_model_dir(tmp_path_factory.mktemp("hf-tiny"))


def run(tmp_path, *args, name="run"):
    """Run the trainer in this process; (exit code, events, run dir)."""
    return train_in_process(tmp_path / name, *args)


def trained_model(tmp_path, *args, name="live") -> torch.nn.Module:
    """Train in this process and keep the Trainer's model to look at."""
    with restoring_signals():
        t = Trainer(parse_config([*TINY, "--run-dir", str(tmp_path / name), *args]))
        try:
            t.setup()
            assert t.run() == EXIT_OK
        finally:
            t.channel.close()
    return t.raw_model


# --- LoRA on a model directory ------------------------------------------------------------------


@pytest.mark.slow
def test_lora_trains_only_the_adapters_of_a_model_directory(tmp_path, model_dir):
    from safetensors.torch import load_file

    base = load_file(model_dir / "model.safetensors")
    model = trained_model(tmp_path, "--model", str(model_dir), *LORA, "--max-steps", "6")
    seen_frozen = seen_adapter = 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad
            seen_adapter += 1
            if "lora_B" in name:  # starts at zero; training moved it
                assert p.abs().max() > 0
        else:
            assert not p.requires_grad, name
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p.detach(), base[key]), f"frozen weight {key} changed"
            seen_frozen += 1
    assert seen_frozen == len(base) and seen_adapter == 4 * 7 * 2  # 4 layers x 7 projections x (A, B)


@pytest.mark.slow
def test_lora_run_reports_trainable_params_and_checkpoints_only_adapters(tmp_path, model_dir):
    code, events, run_dir = run(
        tmp_path, "--model", str(model_dir), *LORA, "--max-steps", "4", "--checkpoint-every", "2"
    )
    assert code == EXIT_OK
    m = [h for h in of(events, "hello") if not h.early][0].model
    assert 0 < m.trainable_params < m.total_params / 10
    # r (in + out) per projection: q,k,v,o 128x128; gate,up 128->384; down 384->128; 4 layers
    assert m.trainable_params == 4 * 8 * (4 * 256 + 3 * 512)
    state = ckpt.load(rundir.path_for(run_dir, 4))
    assert state["model"] and all("lora_" in k for k in state["model"])
    assert sum(v.numel() for v in state["model"].values()) == m.trainable_params
    steps = of(events, "step")
    assert steps[-1].optim_state_bytes == 2 * 4 * m.trainable_params + 4 * 56  # fp32 moments + step counts
    assert steps[-1].loss < steps[0].loss


@pytest.mark.slow
def test_lora_resume_is_exact(tmp_path, model_dir):
    common = ["--model", str(model_dir), *LORA, "--lora-dropout", "0.1"]  # dropout: the RNG is restored too
    code, full, _ = run(tmp_path, *common, "--max-steps", "6", name="full")
    assert code == EXIT_OK
    code, _, part = run(tmp_path, *common, "--max-steps", "6", "--fault", "stop@3", name="part")
    assert code == EXIT_OK
    code, _, _ = run(tmp_path, "--resume", str(part), "--max-steps", "6", name="part")
    assert code == EXIT_OK
    resumed = list(read_events(part / "events.jsonl"))
    assert [s.loss for s in of(resumed, "step")] == [s.loss for s in of(full, "step")]
    a = ckpt.load(rundir.path_for(tmp_path / "full", 6))
    b = ckpt.load(rundir.path_for(part, 6))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_resume_with_other_lora_options_is_refused(tmp_path):
    code, _, run_dir = run(tmp_path, "--model", "llama", *LORA, "--max-steps", "2")
    assert code == EXIT_OK
    before = sorted(p.name for p in run_dir.rglob("*"))
    with pytest.raises(ConfigError) as e:  # refused where the options enter, before anything
        parse_config([*TINY, "--run-dir", str(run_dir), "--resume", str(run_dir), "--lora", "4", "--max-steps", "4"])
    assert e.value.option == "--lora" and "resume needs the same value" in e.value.message
    assert sorted(p.name for p in run_dir.rglob("*")) == before
    from trainer.checkpointer import Checkpointer  # and by the trainer, from the checkpoint's own config

    cfg = parse_config([*TINY, "--run-dir", str(run_dir), "--max-steps", "4", "--lora", "4"])
    saved = ckpt.load(rundir.list_checkpoints(run_dir)[-1].path)["config"]
    with pytest.raises(ConfigError, match="--lora"):
        Checkpointer(cfg, CPU, run_dir, None, warn=print).check_compatible(saved)


@pytest.mark.slow
def test_lora_on_a_builtin_family(tmp_path):
    for family, n in (("llama", 7), ("deepseek", None)):
        code, events, _ = run(tmp_path, "--model", family, *LORA, "--max-steps", "3", name=family)
        assert code == EXIT_OK
        m = [h for h in of(events, "hello") if not h.early][0].model
        assert 0 < m.trainable_params < m.total_params


@pytest.mark.parametrize("family", ["llama", "llada", "deepseek"])
def test_a_rank_above_the_smallest_adapted_dimension_and_unknown_targets_are_refused(family):
    """The same rule before anything is built (trainer.contract.estimate, from the dimensions) and on the built
    model (trainer.lora, which a model directory gets): a rank above the smallest dimension of a layer it adapts
    is refused naming --lora; a target that is not there, or the output head, naming --lora-targets, with what
    can be targeted (never lm_head)."""
    from trainer.contract import estimate
    from trainer.lora import targets
    from trainer.models import build_model

    b = build_model(ModelConfig(model=family, size="tiny"), vocab_size=512, seq_len=64, toggles=Toggles(), dev=CPU)
    limit = min(min(t.shape[-2:]) for t in estimate.adapted_tensors(family, "tiny"))
    estimate.check_lora(family, "tiny", limit)
    with pytest.raises(ConfigError, match=f"use --lora {limit} or less") as e:
        estimate.check_lora(family, "tiny", limit + 1)
    assert e.value.option == "--lora"
    if family != "deepseek":  # its fused experts are no Linear modules: the dimensions' rule only
        targets(b.model, FinetuneConfig(lora=limit))
        with pytest.raises(ConfigError, match=f"use --lora {limit} or less"):
            targets(b.model, FinetuneConfig(lora=limit + 1))
    for bad in ("nonexistent", "q_proj,lm_head"):
        for check in (
            lambda: estimate.check_lora(family, "tiny", 8, bad),
            lambda: targets(b.model, FinetuneConfig(lora=8, lora_targets=bad)),
        ):
            with pytest.raises(ConfigError) as e:
                check()
            listed = e.value.message.split("what can be targeted: ")[1]
            assert e.value.option == "--lora-targets" and "q_proj" in listed and "lm_head" not in listed


def test_lora_targets_are_checked_against_the_model():
    from trainer.lora import targets
    from trainer.models import build_model

    b = build_model(ModelConfig(model="deepseek", size="tiny"), vocab_size=512, seq_len=64, toggles=Toggles(), dev=CPU)
    assert targets(b.model, FinetuneConfig(lora=8)) == [
        "q_proj",
        "o_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert targets(b.model, FinetuneConfig(lora=8, lora_targets="q_proj,kv_b_proj")) == ["q_proj", "kv_b_proj"]
    with pytest.raises(ConfigError) as e:
        targets(b.model, FinetuneConfig(lora=8, lora_targets="q_proj,c_attn"))
    assert e.value.option == "--lora-targets" and "c_attn" in e.value.message and "kv_b_proj" in e.value.message


@pytest.mark.parametrize(
    "args,option",
    [
        (["--lora", "-1"], "--lora"),
        (["--lora", "8", "--lora-dropout", "1"], "--lora-dropout"),
        (["--lora", "8", "--lora-alpha", "0"], "--lora-alpha"),
        (["--lora", "8", "--lora-targets", "q_proj;v_proj"], "--lora-targets"),
        (["--quantize-base", "nf4"], "--quantize-base"),  # needs --lora
        (["--optimizer", "sgd"], "--optimizer"),
    ],
)
def test_bad_finetune_options_name_the_option(args, option, capsys):
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_config([*TINY, *args])
    if isinstance(e.value, ConfigError):
        assert e.value.option == option
    else:  # argparse refused it: exit 2, the option named on stderr
        assert e.value.code == 2 and option in capsys.readouterr().err


# --- capabilities -------------------------------------------------------------------------------


def test_quantized_base_is_gated_with_a_reason(monkeypatch):
    assert "CUDA" in capabilities.support("quantize_base", "nf4", CPU)
    assert "CUDA" in capabilities.support("quantize_base", "int8", CPU)
    assert capabilities.support("quantize_base", "none", CPU) is None
    monkeypatch.setattr(capabilities, "_installed", lambda m: m != "bitsandbytes")
    assert "pip install 'gptop[qlora]'" in capabilities.support("quantize_base", "nf4", H100)
    monkeypatch.setattr(capabilities, "_installed", lambda m: True)
    assert capabilities.support("quantize_base", "nf4", H100) is None  # documentation-verified only
    cfg = parse_config([*TINY, "--lora", "8", "--quantize-base", "nf4"])
    with pytest.raises(ConfigError) as e:
        capabilities.check_config(cfg, CPU)
    assert e.value.option == "--quantize-base" and "CUDA" in e.value.message


def test_quantized_base_on_cpu_exits_2_naming_the_option(tmp_path, model_dir, capsys):
    code, events, run_dir = run(
        tmp_path, "--model", str(model_dir), "--lora", "8", "--quantize-base", "nf4", "--max-steps", "2"
    )
    assert code == EXIT_CONFIG
    assert "error (config): --quantize-base" in capsys.readouterr().err
    assert not run_dir.exists()  # a refusal leaves no run directory behind


def test_low_bit_optimizers_are_gated_on_a_compiler(monkeypatch):
    import dataclasses

    no_cc = dataclasses.replace(CPU, has_compiler=False)
    for value in ("adamw-8bit", "adamw-4bit"):
        assert capabilities.support("optimizer", value, CPU) is None
        assert "compiler" in capabilities.support("optimizer", value, no_cc)
    for value in ("adamw", "adafactor"):
        assert capabilities.support("optimizer", value, no_cc) is None
    assert "7-12x slower" in capabilities.slow("optimizer", "adamw-8bit", CPU)  # runs, with a warning
    assert capabilities.slow("optimizer", "adamw-8bit", H100) is None
    (line,) = capabilities.slow_config(parse_config([*TINY, "--optimizer", "adamw-4bit"]), CPU)
    assert line.startswith("--optimizer adamw-4bit: torchao's")
    monkeypatch.setattr(capabilities, "_installed", lambda m: m != "torchao")
    assert "pip install torchao" in capabilities.support("optimizer", "adamw-8bit", CPU)


# --- FLOPs with frozen weights ------------------------------------------------------------------


def test_frozen_weights_count_four_flops_per_token():
    from trainer.flops import flops_per_token
    from trainer.models import _attention_shape, build_model

    kw = dict(vocab_size=512, seq_len=64, toggles=Toggles(), dev=CPU)
    full = build_model(ModelConfig(model="llama", size="tiny"), **kw)
    lora = build_model(ModelConfig(model="llama", size="tiny"), finetune=FinetuneConfig(lora=8), **kw)
    n = full.total_params - full.embedding_params  # untied: the head is a matmul, the embedding not
    a = lora.trainable_params
    L, H, Q, V = _attention_shape(full.hf_config)
    attention = 6 * L * H * (Q + V) * 64
    assert full.flops_per_token == 6 * n + attention
    assert lora.flops_per_token == 6 * a + 4 * n + attention
    assert lora.flops_per_token == flops_per_token(a, L, H, Q, 64, v_head_dim=V, frozen_params=n)
    assert lora.flops_per_token < full.flops_per_token


# --- optimizers ---------------------------------------------------------------------------------


def _train_and_resume(tmp_path, *args):
    code, full, _ = run(tmp_path, *args, "--max-steps", "6", name="full")
    assert code == EXIT_OK
    code, _, part = run(tmp_path, *args, "--max-steps", "6", "--fault", "stop@3", name="part")
    assert code == EXIT_OK
    code, _, _ = run(tmp_path, "--resume", str(part), "--max-steps", "6", name="part")
    assert code == EXIT_OK
    resumed = list(read_events(part / "events.jsonl"))
    want = [s.loss for s in of(full, "step")]
    assert [s.loss for s in of(resumed, "step")] == want
    assert want[-1] < want[0]
    return of(full, "step")


@pytest.mark.slow
def test_adafactor_trains_and_resumes(tmp_path):
    steps = _train_and_resume(
        tmp_path, "--model", "llama", "--optimizer", "adafactor", "--lr", "1e-2", "--micro-batch", "2"
    )
    adamw = run(tmp_path, "--model", "llama", "--max-steps", "1", "--micro-batch", "2", name="adamw")[1]
    # a factored second moment: far smaller than AdamW's two fp32 moments
    assert steps[-1].optim_state_bytes < of(adamw, "step")[-1].optim_state_bytes / 10


@pytest.mark.process
@pytest.mark.compile  # torchao's low-bit AdamW compiles its update with torch.compile
@pytest.mark.parametrize("optimizer,ratio", [("adamw-8bit", 3.0), ("adamw-4bit", 5.0)])
def test_low_bit_adamw_trains_and_resumes(tmp_path, optimizer, ratio):
    steps = _train_and_resume(
        tmp_path, "--model", "llama", "--optimizer", optimizer, "--lr", "3e-3", "--micro-batch", "2"
    )
    adamw = run(tmp_path, "--model", "llama", "--max-steps", "1", "--micro-batch", "2", name="adamw")[1]
    assert steps[-1].optim_state_bytes < of(adamw, "step")[-1].optim_state_bytes / ratio


@pytest.mark.process
@pytest.mark.compile
def test_lora_with_an_8bit_optimizer_resumes(tmp_path, model_dir):
    _train_and_resume(tmp_path, "--model", str(model_dir), *LORA, "--optimizer", "adamw-8bit")


# --- what the dashboard and the headless lines show -------------------------------------------


def test_views_show_trainable_params_and_optimizer_state():
    from gptop.headless import step_line
    from gptop.state import RunState, model_summary
    from trainer.contract.events import ModelInfo, StepEvent

    lora = ModelInfo(
        family="pretrained", size="pretrained", total_params=3_000_000, active_params=3_000_000, trainable_params=75_000
    )
    assert model_summary(lora).endswith("3.0M params · 75.0k trainable (2.5%)")
    full = ModelInfo(
        family="llama", size="tiny", total_params=3_000_000, active_params=3_000_000, trainable_params=3_000_000
    )
    assert "trainable" not in model_summary(full)
    step = StepEvent(
        step=1,
        tokens=256,
        loss=2.0,
        lr=1e-3,
        grad_norm=1.0,
        step_ms=10.0,
        phases_ms=None,
        tokens_per_s=100.0,
        mfu=None,
        mem_bytes=1 << 20,
        optim_state_bytes=2 << 20,
    )
    assert "mem 1.0 MB (optimizer 2.0 MB)" in step_line(step, RunState())


# --- export: the adapter in peft's format, or merged --------------------------------------------

# Runs without gptop (helpers.run_without_gptop), outside the repository: what a user without gptop does with
# each export. Each load is (how, where): peft's AutoPeftModelForCausalLM from a working directory, PeftModel on a
# base loaded explicitly, or plain transformers; each with its input ids.
PLAIN = """
import json, os, sys
import torch
from transformers import AutoModelForCausalLM
from peft import AutoPeftModelForCausalLM, PeftModel
torch.set_num_threads(1)
job = json.loads(sys.argv[1])
out, kinds = {}, {}
for name, load in job["loads"].items():
    if load["how"] == "auto":
        os.chdir(load["cwd"])
        model = AutoPeftModelForCausalLM.from_pretrained(load["dir"])
    elif load["how"] == "peft":
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(load["base"]), load["dir"])
    else:
        model = AutoModelForCausalLM.from_pretrained(load["dir"])
    with torch.no_grad():
        out[name] = model.eval()(input_ids=torch.load(load["ids"])).logits
    kinds[name] = type(model).__name__
torch.save(out, job["out"])
print(json.dumps(kinds))
"""


def _export(run_dir, out_dir, *flags):
    import argparse

    from trainer.contract import tools
    from trainer.export import export

    p = argparse.ArgumentParser()
    tools.add_export_arguments(p)
    return export(p.parse_args([str(run_dir), str(out_dir), *flags]), log=lambda s: None)


def _plain(tmp_path, loads):
    """Every load of `loads` ({name: load, with its ids tensor}) in one plain Python; (type names, logits)."""
    import json

    for name, load in loads.items():
        torch.save(load.pop("ids"), tmp_path / f"{name}.ids.pt")
        load["ids"] = str(tmp_path / f"{name}.ids.pt")
    job = {"loads": loads, "out": str(tmp_path / "logits.pt")}
    r = run_without_gptop(PLAIN, json.dumps(job), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), torch.load(tmp_path / "logits.pt")


def _reference(run_dir, tmp_path):
    """The run's own model on a fixed batch: (its input ids, its logits)."""
    from trainer.contract import tools
    from trainer.export import check_batch, load_for_inference

    ref = load_for_inference(run_dir, tools.check_export(argparse_ns(run_dir, tmp_path / "x")), log=lambda s: None)
    ids = check_batch(len(ref.tokenizer), None, 32, seed=3)
    with torch.no_grad():
        return ids, ref.model(input_ids=ids).logits


def _adapter_and_merged(tmp_path, model_dir, source):
    """A LoRA run (on the model directory, or a builtin llama) exported as an adapter and merged; what a plain
    Python is to load from them, and what each load must equal."""
    model = str(model_dir) if source == "model_dir" else "llama"
    code, _, run_dir = run(tmp_path, "--model", model, *LORA, "--max-steps", "3")
    assert code == EXIT_OK
    adapter = _export(run_dir, tmp_path / "adapter")
    merged = _export(run_dir, tmp_path / "merged", "--merge")
    ids, want = _reference(run_dir, tmp_path)
    adapter_dir = tmp_path / "adapter"
    base = str(adapter_dir / "base") if source == "llama" else str(model_dir)
    auto = {"how": "auto", "dir": "." if source == "llama" else str(adapter_dir), "cwd": str(adapter_dir)}
    loads = {
        "auto": auto,
        "peft": {"how": "peft", "dir": str(adapter_dir), "base": base},
        "merged": {"how": "plain", "dir": str(tmp_path / "merged")},
    }
    return {"dir": tmp_path, "adapter": adapter, "merged": merged, "ids": ids, "want": want}, loads


def _copied_and_moved(tmp_path):
    """An adapter export copied away and moved, then another run (another seed: another base) exported to the
    original place; the loads of the copy, the moved one and the re-export."""
    import shutil

    code, _, run_a = run(tmp_path, "--model", "llama", *LORA, "--max-steps", "2", name="a")
    code_b, _, run_b = run(tmp_path, "--model", "llama", *LORA, "--max-steps", "2", "--seed", "5", name="b")
    assert code == code_b == EXIT_OK
    out = tmp_path / "exports" / "out"
    _export(run_a, out)
    readme = (out / "README.md").read_text()
    shutil.copytree(out, tmp_path / "copy")
    shutil.move(str(out), str(tmp_path / "moved"))
    _export(run_b, out)  # another base where the first one was
    ids, want = _reference(run_a, tmp_path)
    loads = {
        name: {"how": "peft", "dir": str(tmp_path / name), "base": str(tmp_path / name / "base")}
        for name in ("copy", "moved")
    }
    loads["auto"] = {"how": "auto", "dir": ".", "cwd": str(tmp_path / "copy")}
    loads["other"] = {"how": "peft", "dir": str(out), "base": str(out / "base")}
    return {"dir": tmp_path, "out": out, "readme": readme, "ids": ids, "want": want}, loads


@pytest.fixture(scope="module")
def plain_loads(tmp_path_factory, model_dir) -> dict[str, dict]:
    """The exports of the tests below, made in this process, then all loaded in one plain Python (its start-up,
    importing torch, transformers and peft, is most of its time): {case: what the case made, with `kinds` and
    `got`, the loads' type names and logits by load name}."""
    made, loads = {}, {}
    for source in ("model_dir", "llama"):
        made[source], loads[source] = _adapter_and_merged(tmp_path_factory.mktemp(source), model_dir, source)
    made["moved"], loads["moved"] = _copied_and_moved(tmp_path_factory.mktemp("moved"))
    every = {
        f"{case}.{name}": {**load, "ids": made[case]["ids"]} for case in loads for name, load in loads[case].items()
    }
    kinds, got = _plain(tmp_path_factory.mktemp("plain"), every)
    for case in made:
        made[case]["kinds"] = {name: kinds[f"{case}.{name}"] for name in loads[case]}
        made[case]["got"] = {name: got[f"{case}.{name}"] for name in loads[case]}
    return made


@pytest.mark.process
@pytest.mark.slow  # starts a plain Python
@pytest.mark.parametrize("source", ["model_dir", "llama"])
def test_lora_exports_load_with_peft_and_plain_transformers(plain_loads, model_dir, source):
    import json

    case = plain_loads[source]
    adapter, merged, want, got = case["adapter"], case["merged"], case["want"], case["got"]
    assert adapter["format"] == "peft-adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= set(adapter["files"])
    config = json.loads((case["dir"] / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == adapter["base_model"]
    if source == "model_dir":
        assert adapter["base_model"] == str(model_dir.resolve())  # outside the export: where it is
    else:
        assert adapter["base_model"] == "base"  # inside: relative, it moves with the export
    assert merged["format"] == "merged" and "model.safetensors" in merged["files"]
    assert not any("lora" in k for k in json.loads((case["dir"] / "merged" / "config.json").read_text()))
    assert case["kinds"] == {
        "auto": "PeftModelForCausalLM",
        "peft": "PeftModelForCausalLM",
        "merged": "LlamaForCausalLM",
    }
    assert torch.equal(got["auto"], want) and torch.equal(got["peft"], want)
    assert torch.allclose(got["merged"], want, atol=1e-4, rtol=0)  # merging rounds W + (a/r) B A once


@pytest.mark.process
@pytest.mark.slow  # starts a plain Python
def test_a_copied_or_moved_adapter_export_keeps_its_own_base(plain_loads):
    """Export, copy the export away and move the original, then export another run (another seed: another
    base) to the original place: the copy and the moved one still load their own base, with peft as the
    README says and with gptop sample; a base replaced under an export is refused, not silently used."""
    import argparse
    import json
    import shutil

    from trainer.contract import tools
    from trainer.export import load_for_inference
    from trainer.sample import generate

    case = plain_loads["moved"]
    tmp_path, out, ids, want, got = case["dir"], case["out"], case["ids"], case["want"], case["got"]
    assert "PeftModel.from_pretrained" in case["readme"]
    for name in ("copy", "moved", "auto"):
        assert torch.equal(got[name], want), name
    assert not torch.allclose(got["other"], want)  # the re-export is another model

    p = argparse.ArgumentParser()
    tools.add_sample_arguments(p)
    for name in ("copy", "moved"):  # gptop sample takes an adapter export
        ns = p.parse_args([str(tmp_path / name), "--prompt", "def f(", "--max-new-tokens", "4", "--temperature", "0"])
        loaded = load_for_inference(ns.path, tools.check_sample(ns), log=lambda s: None)
        with torch.no_grad():
            assert torch.equal(loaded.model(input_ids=ids).logits, want), name
        assert generate(loaded, ns).new_tokens >= 0
    shutil.rmtree(tmp_path / "copy" / "base")  # a copy without its base ...
    shutil.copytree(out / "base", tmp_path / "copy" / "base")  # ... given another one
    ns = p.parse_args([str(tmp_path / "copy")])
    with pytest.raises(ConfigError, match="not the one this adapter was trained on"):
        tools.check_sample(ns)
    marker = json.loads((tmp_path / "moved" / "gptop-export.json").read_text())
    assert marker["format"] == "peft-adapter" and marker["base"] == "base" and marker["base_fingerprint"]


def argparse_ns(run_dir, out_dir):
    import argparse

    return argparse.Namespace(
        run_dir=str(run_dir), out_dir=str(out_dir), step=None, force=False, json=True, merge=False
    )


def test_merge_without_lora_is_refused(tmp_path):
    code, _, run_dir = run(tmp_path, "--model", "llama", "--max-steps", "1")
    assert code == EXIT_OK
    with pytest.raises(ConfigError) as e:
        _export(run_dir, tmp_path / "out", "--merge")
    assert e.value.option == "--merge" and "no --lora" in e.value.message
    assert not (tmp_path / "out").exists()


def test_lora_with_fsdp_is_refused_naming_the_option():
    cfg = parse_config([*TINY, "--lora", "8", "--parallel", "fsdp"])  # one process: --parallel is ignored
    with pytest.raises(ConfigError) as e:
        cfg.validate(world_size=2)
    assert e.value.option == "--parallel" and "ddp" in e.value.message


def test_a_lora_run_samples(tmp_path):
    import argparse

    from trainer.contract import tools
    from trainer.sample import sample

    code, _, run_dir = run(tmp_path, "--model", "llama", *LORA, "--max-steps", "2")
    assert code == EXIT_OK
    p = argparse.ArgumentParser()
    tools.add_sample_arguments(p)
    ns = p.parse_args([str(run_dir), "--prompt", "def f(", "--max-new-tokens", "5", "--temperature", "0"])
    result = sample(ns, started=time.time())  # --timeout counts from now, not from pytest's start
    assert result.step == 2 and result.new_tokens == 5 and result.stopped == "max_new_tokens"
