"""`gptop export` and `gptop sample`: a run's model as a Hugging Face directory, and text from it.

The fast tests train three tiny runs in this process (one per family, checkpoints at steps 2
and 4) and export and sample them in-process; the slow ones run the real commands
(`gptop export|sample|train --model OUT`), a checkpoint written by two ranks (DCP), and load
every export in a Python that cannot import gptop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT, TINY, gptop_cmd, gptop_env, run_gptop, run_without_gptop, start_gptop, train_in_process
from trainer.contract import rundir, tools
from trainer.contract.config import ConfigError, ModelConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.tools import SampleResult

FAMILIES = ("llama", "deepseek", "llada")
# Every family, the inner tier keeping llama (the others are `slow`).
FAMILY_TIERS = [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
CPU = DeviceInfo(type="cpu", name="test-cpu", cpu_count=2, total_memory=8 << 30)


def train_ok(run_dir: Path, *args: str) -> None:
    from trainer.train import EXIT_OK

    assert train_in_process(run_dir, *args)[0] == EXIT_OK


class PerFamily(Mapping[str, Any]):
    """family -> `make(family)`, made when a test first reads that family (the inner tier reads llama only); its
    keys are every family, so iterating over it, or `{**it}`, makes them all."""

    def __init__(self, make: Callable[[str], Any]) -> None:
        self.make = make
        self.made: dict[str, Any] = {}

    def __getitem__(self, family: str) -> Any:
        if family not in FAMILIES:
            raise KeyError(family)
        if family not in self.made:
            self.made[family] = self.make(family)
        return self.made[family]

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Mapping[str, Path]:
    """One tiny run per family, 4 steps, checkpoints at steps 2 and 4 (one-file)."""
    base = tmp_path_factory.mktemp("export-runs")

    def train(family: str) -> Path:
        train_ok(base / family, "--model", family, "--max-steps", "4", "--checkpoint-every", "2", "--lr", "3e-3")
        return base / family

    return PerFamily(train)


@pytest.fixture(scope="module")
def family_exports(runs, tmp_path_factory) -> Mapping[str, tuple[Path, dict]]:
    """Each family's run exported in this process, once: (the export, export()'s result). Tests read them."""
    from trainer.export import export

    base = tmp_path_factory.mktemp("family-exports")
    return PerFamily(lambda family: (base / family, export(export_ns(runs[family], base / family), log=quiet)))


def export_ns(
    run_dir: Path, out_dir: Path, step: int | None = None, force: bool = False, merge: bool = False
) -> argparse.Namespace:
    return argparse.Namespace(
        run_dir=str(run_dir), out_dir=str(out_dir), step=step, force=force, merge=merge, json=True
    )


def sample_ns(path: Path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tools.add_sample_arguments(p)
    ns = p.parse_args([str(path)])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


quiet = lambda msg: None  # noqa: E731


# --- the contract: arguments and checks, without torch ------------------------------------------


def fake_run(tmp_path: Path, steps=(2, 4)) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    for s in steps:
        rundir.path_for(run, s).write_bytes(b"x")
    return run


@pytest.mark.parametrize(
    "case, option",
    [
        (lambda t, run: export_ns(t / "missing", t / "out"), "RUN_DIR"),
        (lambda t, run: export_ns(run / "config.toml", t / "out"), "RUN_DIR"),
        (lambda t, run: export_ns(t, t / "out"), "RUN_DIR"),  # not a run
        (lambda t, run: export_ns(run, t / "out", step=3), "--step"),
        (lambda t, run: export_ns(run, t / "out", step=-1), "--step"),
        (lambda t, run: export_ns(run, run / "config.toml"), "OUT_DIR"),  # a file
        (lambda t, run: export_ns(run, run), "OUT_DIR"),  # the run itself
        (lambda t, run: export_ns(run, t, force=True), "OUT_DIR"),  # holds the run
        (lambda t, run: export_ns(run, run / "checkpoints"), "OUT_DIR"),  # not empty
    ],
)
def test_export_checks_name_the_option(tmp_path, case, option):
    run = fake_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        tools.check_export(case(tmp_path, run))
    assert e.value.option == option, str(e.value)


def test_export_check_accepts_new_empty_or_forced_out_dirs(tmp_path):
    run = fake_run(tmp_path)
    assert [c.step for c in tools.check_export(export_ns(run, tmp_path / "new"))] == [4, 2]  # newest first
    (tmp_path / "empty").mkdir()
    assert [c.step for c in tools.check_export(export_ns(run, tmp_path / "empty", step=2))] == [2]
    with pytest.raises(ConfigError, match="checkpoints"):  # --force never replaces a run's checkpoints/
        tools.check_export(export_ns(run, run / "checkpoints", force=True))
    assert tools.check_export(export_ns(run, run / "hf"))  # inside the run is fine
    (run / "checkpoints" / "step-00000004.pt").unlink()
    (run / "checkpoints" / "step-00000002.pt").unlink()
    with pytest.raises(ConfigError, match="made no checkpoint"):
        tools.check_export(export_ns(run, tmp_path / "new"))


@pytest.mark.parametrize(
    "change, option",
    [
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"temperature": -0.5}, "--temperature"),
        ({"temperature": float("nan")}, "--temperature"),
        ({"diffusion_steps": 0}, "--diffusion-steps"),
        ({"diffusion_steps": 65}, "--diffusion-steps"),
        ({"timeout": 0.0}, "--timeout"),
        ({"timeout": float("inf")}, "--timeout"),
        ({"step": 3}, "--step"),
        ({"step": -2}, "--step"),
        ({"prompt": "a\udcff\udcfeb"}, "--prompt"),
        ({"prompt": "x\ud800"}, "--prompt"),  # not UTF-8 (argv's bytes)
        ({"device": "cuda:x"}, "--device"),
        ({"device": "gpu"}, "--device"),
    ],
)
def test_sample_checks_name_the_option(tmp_path, change, option):
    ns = sample_ns(fake_run(tmp_path), **change)
    with pytest.raises(ConfigError) as e:
        tools.check_sample(ns)
    assert e.value.option == option


def test_sample_takes_a_model_directory_without_steps(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert tools.check_sample(sample_ns(tmp_path / "m")) is None
    with pytest.raises(ConfigError) as e:
        tools.check_sample(sample_ns(tmp_path / "m", step=2))
    assert e.value.option == "--step"


def test_argv_round_trips_through_the_tool_parsers(tmp_path):
    run = fake_run(tmp_path)
    p = argparse.ArgumentParser()
    tools.add_sample_arguments(p)
    ns = sample_ns(
        run,
        prompt="-- a prompt that looks like a flag",
        max_new_tokens=7,
        temperature=0.3,
        seed=9,
        step=2,
        diffusion_steps=3,
        timeout=12.5,
        device="cpu",
        json=True,
    )
    assert vars(p.parse_args(tools.sample_argv(ns))) == vars(ns)
    q = argparse.ArgumentParser()
    tools.add_export_arguments(q)
    for merge in (False, True):
        ns = export_ns(run, tmp_path / "o", step=2, force=True, merge=merge)
        assert vars(q.parse_args(tools.export_argv(ns))) == vars(ns)
    cmd = tools.sample_command(run, "hi", max_new_tokens=5)
    assert cmd[:3] == [sys.executable, "-m", "trainer.sample"] and "--json" in cmd


def test_sample_result_json_line():
    r = SampleResult(
        source="s",
        step=4,
        family="llada",
        objective="llada",
        prompt="a",
        completion="b\nc",
        new_tokens=3,
        stopped="eos",
        temperature=0.0,
        seed=1,
        seconds=0.5,
        load_seconds=2.0,
        diffusion_steps=3,
    )
    line = r.to_json()
    assert "\n" not in line
    assert SampleResult.from_json(line) == r and r.text == "ab\nc"
    d = json.loads(line)
    d["added_later"] = 1
    assert SampleResult.from_json(json.dumps(d)) == r
    with pytest.raises(ValueError):
        SampleResult.from_json('{"type": "export"}')


def test_gptop_rejects_bad_input_before_starting_anything(tmp_path, monkeypatch, capsys):
    from gptop import cli

    def no_process(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    run = fake_run(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert cli.main(["export", str(run), str(tmp_path / "full")]) == 2
    assert "OUT_DIR" in capsys.readouterr().err and (tmp_path / "full" / "x").read_text() == "keep me"
    assert cli.main(["sample", str(run), "--step", "5"]) == 2
    assert "--step" in capsys.readouterr().err
    assert cli.main(["sample", str(run), "--prompt", "a\udcff\udcfeb"]) == 2  # `$(printf 'a\xff\xfeb')`
    err = capsys.readouterr().err
    assert "--prompt" in err and "byte 0xff" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exited:  # argparse refuses the path itself (its type checks it)
        cli.main(["--no-ui", "sample", str(tmp_path / "nope"), "--json"])
    assert exited.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_a_killed_tool_is_named_with_its_signal_and_the_oom_killer_when_the_kernel_counted_one(monkeypatch):
    from gptop import tool_runner as gtools

    counts = iter([7])
    monkeypatch.setattr(gtools, "oom_kills", lambda: next(counts))
    assert gtools.killed_words("the export", 9, 6) == (
        "the export was killed by signal 9 (SIGKILL): the kernel's "
        "out-of-memory killer ended it: the model did not fit in the "
        "memory left"
    )
    monkeypatch.setattr(gtools, "oom_kills", lambda: None)
    assert "most likely out of memory" in gtools.killed_words("the sampler", 9, None)
    assert gtools.killed_words("the sampler", 15, None).endswith("(SIGTERM): not by gptop")


@pytest.mark.process
def test_gptop_runs_a_tool_to_its_end(monkeypatch, capsys):
    """Exit codes pass through; a tool past its time limit, or asked to stop, is ended, not left behind."""
    import threading

    import psutil

    from gptop import tool_runner as gtools

    def script(code: str):
        monkeypatch.setattr(tools, "tool_command", lambda module, argv: [sys.executable, "-c", code])

    script("import sys; sys.exit(2)")
    assert gtools.run_tool("x", []) == 2
    script("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")  # what the OOM killer does
    assert gtools.run_tool(tools.SAMPLE_MODULE, []) == 1
    said = capsys.readouterr().err
    assert "the sampler was killed by signal 9 (SIGKILL)" in said and "out of memory" in said
    script("import time; time.sleep(60)")
    children = lambda: [c for c in psutil.Process().children() if "time.sleep(60)" in " ".join(c.cmdline())]
    t0 = time.monotonic()
    assert gtools.run_tool("x", [], timeout=1) == 1 and time.monotonic() - t0 < 30
    assert children() == []
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    assert gtools.run_tool("x", []) == 130  # SIGTERM to gptop reaches the tool
    assert children() == [] and signal.getsignal(signal.SIGTERM) == before


# --- llada's reverse process on a predictor whose confidences are known ---------------------------

MASK, VOCAB, ROWS = 1, 10, 12  # ids 10, 11: padding rows of the model's vocabulary


class FixedPredictor(torch.nn.Module):
    """Logits that depend only on the position; records the input of every call."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.inputs: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor):
        self.inputs.append(input_ids.clone())
        return SimpleNamespace(logits=self.table[None, : input_ids.shape[1]].clone())


def fixed_table(prompt_len: int, confidence: list[float], tokens: list[int]) -> torch.Tensor:
    """Completion position j predicts tokens[j] with a margin that grows with confidence[j]; the mask
    token and a padding row score higher still (they must never be chosen)."""
    t = torch.zeros(prompt_len + len(tokens), ROWS)
    for j, (c, tok) in enumerate(zip(confidence, tokens)):
        t[prompt_len + j, tok] = c
        t[prompt_len + j, MASK] = 100.0
        t[prompt_len + j, VOCAB + 1] = 100.0
    return t


def test_llada_unmasks_the_most_confident_predictions_first():
    from trainer.sample import llada_generate

    prompt = torch.tensor([[7, 8]])
    tokens = [2, 3, 4, 5, 6, 9]
    conf = [5.0, 3.0, 1.0, 6.0, 2.0, 4.0]  # order: pos 3, 0, 5, 1, 4, 2
    model = FixedPredictor(fixed_table(2, conf, tokens))
    out, done = llada_generate(model, prompt, mask_id=MASK, length=6, steps=3, vocab=VOCAB)
    assert done == 3 and out.tolist() == tokens
    masked = [(x[0, 2:] == MASK).nonzero().flatten().tolist() for x in model.inputs]
    assert masked == [[0, 1, 2, 3, 4, 5], [1, 2, 4, 5], [2, 4]]  # 2 unmasked per step, most confident first
    assert all(x[0, :2].tolist() == [7, 8] for x in model.inputs)  # the prompt is never touched


def test_llada_step_counts_follow_the_linear_schedule():
    from trainer.sample import llada_generate

    model = FixedPredictor(fixed_table(1, [float(i) for i in range(7)], [2] * 7))
    llada_generate(model, torch.tensor([[3]]), mask_id=MASK, length=7, steps=3, vocab=VOCAB)
    still = [int((x[0, 1:] == MASK).sum()) for x in model.inputs]
    assert still == [7, 7 - 7 * 1 // 3, 7 - 7 * 2 // 3]  # floor(L * k / N) unmasked after step k


def test_llada_sampling_is_reproducible_and_stays_in_the_vocabulary():
    from trainer.sample import llada_generate

    torch.manual_seed(0)
    table = torch.randn(10, ROWS)
    table[:, MASK] += 5
    runs = []
    for seed in (1, 1, 2):
        out, _ = llada_generate(
            FixedPredictor(table),
            torch.tensor([[3, 4]]),
            mask_id=MASK,
            length=8,
            steps=4,
            temperature=1.5,
            generator=torch.Generator().manual_seed(seed),
            vocab=VOCAB,
        )
        assert all(0 <= t < VOCAB and t != MASK for t in out.tolist())
        runs.append(out.tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_llada_deadline_keeps_what_it_has():
    from trainer.sample import llada_generate

    model = FixedPredictor(fixed_table(1, [1.0, 2.0, 3.0, 4.0], [2, 3, 4, 5]))
    out, done = llada_generate(
        model, torch.tensor([[6]]), mask_id=MASK, length=4, steps=4, vocab=VOCAB, deadline=time.time() - 1
    )
    assert done == 1 and len(model.inputs) == 1 and out.tolist() == [2, 3, 4, 5]  # filled with the predictions


# --- export and sample in this process -----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_TIERS)
def test_export_round_trip(runs, family_exports, tmp_path, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.export import check_batch, load_for_inference

    out, result = family_exports[family]
    assert result["step"] == 4 and result["family"] == family and result["logits_equal"]
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(os.listdir(out))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    config = json.loads((out / "config.json").read_text())
    assert config["gptop"]["family"] == family and config["gptop"]["step"] == 4

    ref = load_for_inference(runs[family], tools.check_export(export_ns(runs[family], tmp_path / "x")), log=quiet)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == ("DeepseekV3ForCausalLM" if family == "deepseek" else "LlamaForCausalLM")
    ids = check_batch(len(tok), ref.mask_id, 48, seed=3)
    assert torch.equal(logits(model, ids), logits(ref.model, ids))  # bit-identical: see the docs
    text = "for i in range(10):\n    print(i)\n"
    assert tok(text)["input_ids"] == ref.tokenizer(text)["input_ids"]
    if family == "llada":
        assert config["is_causal"] is False and config["mask_token_id"] == tok.mask_token_id == ref.mask_id
        assert tok.convert_ids_to_tokens(ref.mask_id) == "<|mask|>"
    else:
        assert "is_causal" not in config and config["use_cache"] is True
        gen = json.loads((out / "generation_config.json").read_text())
        assert gen["eos_token_id"] == tok.eos_token_id and gen["pad_token_id"] == tok.pad_token_id


def test_the_documented_snippet_runs(family_exports, capsys):
    """docs/models.md's three lines of plain transformers, on an export of a run."""
    import re

    code = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "models.md").read_text(), re.S)[0]
    assert len([line for line in code.splitlines() if line.strip()]) == 3 and '"hf/demo"' in code
    path = family_exports["llama"][0]  # trained and exported here when no earlier test of this process did
    capsys.readouterr()  # what training and exporting printed: not the snippet's
    exec(code.replace('"hf/demo"', repr(str(path))), {})
    assert capsys.readouterr().out.startswith("def main(")


def test_gptop_restores_a_llada_export(family_exports):
    """Loading an export back (`--model OUT_DIR`): bidirectional attention and the llada objective and mask."""
    from trainer.models import build_model

    out = family_exports["llada"][0]
    mask = json.loads((out / "config.json").read_text())["mask_token_id"]
    bundle = build_model(
        ModelConfig(model=str(out)), vocab_size=8192, seq_len=64, toggles=Toggles(), dev=CPU, mask_id=None
    )
    assert bundle.objective == "llada" and bundle.mask_id == mask
    ids = torch.randint(0, 100, (1, 16))
    changed = ids.clone()
    changed[0, -1] += 1
    first = logits(bundle.model.eval(), ids)[0, 0] - logits(bundle.model, changed)[0, 0]
    assert first.abs().max() > 0  # the first position sees the last one: bidirectional
    # The model's own mask token wins over a data tokenizer that calls another id the mask.
    other = build_model(
        ModelConfig(model=str(out)), vocab_size=8192, seq_len=64, toggles=Toggles(), dev=CPU, mask_id=mask + 1
    )
    assert other.mask_id == mask


def test_export_step_corrupt_checkpoints_and_force(runs, tmp_path):
    from trainer.export import export

    run = tmp_path / "run"
    shutil.copytree(runs["llama"], run)
    assert export(export_ns(run, tmp_path / "a", step=2), log=quiet)["step"] == 2
    rundir.path_for(run, 4).write_bytes(b"not a checkpoint")
    seen = []
    assert export(export_ns(run, tmp_path / "b"), log=seen.append)["step"] == 2  # the newest that loads
    assert any("skipping step-00000004.pt" in line for line in seen)
    with pytest.raises(ConfigError) as e:
        export(export_ns(run, tmp_path / "c", step=4), log=quiet)
    assert e.value.option == "--step" and not (tmp_path / "c").exists()
    with pytest.raises(ConfigError):
        export(export_ns(run, tmp_path / "a"), log=quiet)  # not empty, no --force
    before = (tmp_path / "a" / "model.safetensors").stat().st_ino
    assert export(export_ns(run, tmp_path / "a", force=True), log=quiet)["step"] == 2
    assert (tmp_path / "a" / "model.safetensors").stat().st_ino != before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_export_refuses_another_builtin_tokenizer(runs, tmp_path):
    """The builtin tokenizer is rebuilt from this environment; one that differs from the run's is refused."""
    from trainer.export import ExportError, export

    run = tmp_path / "run"
    shutil.copytree(runs["llama"], run)
    events = run / "events.jsonl"
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    for e in lines:
        if e["type"] == "hello" and not e.get("early"):  # the early hello has no data yet
            e["data"]["fingerprint"] = "0" * 16
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    with pytest.raises(ExportError, match="GPTOP_BUILTIN_BYTES"):
        export(export_ns(run, tmp_path / "out"), log=quiet)
    assert not (tmp_path / "out").exists()


def greedy(model: torch.nn.Module, ids: list[int], n: int, vocab: int, eos: int) -> list[int]:
    """Greedy decoding by hand (no cache): what `generate` must reproduce at temperature 0."""
    out = []
    x = torch.tensor([ids])
    for _ in range(n):
        last = logits(model, x)[0, -1]
        last[vocab:] = float("-inf")
        t = int(last.argmax())
        if t == eos:
            break
        out.append(t)
        x = torch.cat([x, torch.tensor([[t]])], dim=1)
    return out


@pytest.mark.parametrize("family", FAMILY_TIERS)
def test_sample_in_process(runs, family):
    from trainer.export import eos_id, load_for_inference
    from trainer.sample import encode_prompt, generate, sample

    ns = sample_ns(runs[family], prompt="def main(", max_new_tokens=12, temperature=0.0)
    loaded = load_for_inference(ns.path, tools.check_sample(ns), log=quiet)
    r = generate(loaded, ns)
    assert r.family == family and r.step == 4 and r.prompt == "def main(" and r.text.startswith("def main(")
    assert r.stopped in ("max_new_tokens", "eos") and 0 <= r.new_tokens <= 12
    assert SampleResult.from_json(r.to_json()) == r
    tok = loaded.tokenizer
    ids = encode_prompt(tok, ns.prompt)
    assert ids[0] == tok.eos_token_id  # no BOS: the prompt starts a document
    if family != "llada":
        want = greedy(loaded.model, ids, 12, len(tok), eos_id(tok))
        assert r.completion == tok.decode(want, skip_special_tokens=True)
        assert r.diffusion_steps is None
    else:
        assert r.objective == "llada" and r.diffusion_steps == 12
        assert generate(loaded, ns).completion == r.completion  # greedy: deterministic
    hot = sample_ns(runs[family], prompt="x", max_new_tokens=6, temperature=1.0, seed=5)
    a, b = generate(loaded, hot), generate(loaded, hot)
    assert a.completion == b.completion  # seeded
    with pytest.raises(TimeoutError):
        sample(ns, started=time.time() - 1000)  # --timeout passed while loading
    for tiny in (1e-45, 1e-40, 1e-39, 1e-31):  # below what float32 divides logits by: greedy
        cold = sample_ns(runs[family], prompt="def main(", max_new_tokens=12, temperature=tiny, seed=3)
        assert generate(loaded, cold).completion == r.completion, tiny
    assert (
        generate(
            loaded, sample_ns(runs[family], prompt="def main(", max_new_tokens=4, temperature=1e-29, seed=3)
        ).new_tokens
        >= 0
    )  # just above: sampled, no crash


# --- the real commands (slow) --------------------------------------------------------------------


# The processes side by side each on one thread.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def run_all(
    cmds: dict[str, list[str]], timeout: float = 300, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> dict[str, subprocess.CompletedProcess]:
    """Several commands side by side (their start-up, importing torch, dominates)."""
    procs = {
        k: subprocess.Popen(
            c, cwd=cwd, env=env or gptop_env(**ONE_THREAD), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for k, c in cmds.items()
    }
    out = {}
    for k, p in procs.items():
        so, se = p.communicate(timeout=timeout)
        out[k] = subprocess.CompletedProcess(p.args, p.returncode, so, se)
    return out


@pytest.fixture(scope="module")
def all_runs(runs, tmp_path_factory) -> dict[str, Path]:
    """The three one-process runs and a llama run of two ranks (FSDP2, sharded DCP checkpoints)."""
    dcp = tmp_path_factory.mktemp("export-dcp") / "dcp"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "-m",
            "trainer",
            *TINY,
            "--max-steps",
            "4",
            "--checkpoint-every",
            "2",
            "--lr",
            "3e-3",
            "--parallel",
            "fsdp",
            "--run-dir",
            str(dcp),
        ],
        cwd=ROOT,
        env=gptop_env(**ONE_THREAD),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c.step for c in rundir.list_checkpoints(dcp)] == [2, 4]
    assert all(c.sharded for c in rundir.list_checkpoints(dcp))
    return {**runs, "dcp": dcp}


@pytest.fixture(scope="module")
def exports(all_runs, family_exports, tmp_path_factory) -> dict[str, Path]:
    """Every run exported: the two-rank one by the command (`gptop export --json`), the one-process ones in this
    process (the same worker code, test_export_round_trip; the command's path is the same for every family)."""
    out = tmp_path_factory.mktemp("exports") / "dcp"
    r = run_gptop("--no-ui", "export", str(all_runs["dcp"]), str(out), "--json", cwd=ROOT, env=gptop_env(**ONE_THREAD))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["type"] == "export" and result["step"] == 4 and result["logits_equal"], result
    assert "export: loading" in r.stderr and "Traceback" not in r.stderr
    return {**{family: path for family, (path, _) in family_exports.items()}, "dcp": out}


# Runs without gptop (helpers.run_without_gptop), from a directory outside the repository.
PLAIN = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    jobs = json.loads(sys.argv[1])
    out = {}
    for name, job in jobs.items():
        model = AutoModelForCausalLM.from_pretrained(job["dir"]).eval()
        tok = AutoTokenizer.from_pretrained(job["dir"])
        ids = torch.load(job["batch"])
        with torch.no_grad():
            torch.save(model(input_ids=ids).logits, job["logits"])
        out[name] = {"class": type(model).__name__, "mask": tok.mask_token_id, "eos": tok.eos_token_id,
                     "is_causal": getattr(model.config, "is_causal", True), "len": len(tok),
                     "ids": tok("def f(x):\\n    return x")["input_ids"]}
    assert not [m for m in sys.modules if m.split(".")[0] in ("gptop", "trainer", "tuner")]
    print(json.dumps(out))
""")


@pytest.mark.process
@pytest.mark.slow
def test_plain_transformers_loads_every_export(all_runs, exports, tmp_path):
    """No gptop: AutoModelForCausalLM + AutoTokenizer load each export (three families, a 2-rank DCP
    checkpoint), and the logits equal the checkpoint's bit for bit."""
    from trainer.export import check_batch, load_for_inference

    refs, jobs = {}, {}
    for k, run in all_runs.items():
        ref = load_for_inference(run, tools.check_export(export_ns(run, tmp_path / "unused")), log=quiet)
        ids = check_batch(len(ref.tokenizer), ref.mask_id, 64, seed=7)
        torch.save(ids, tmp_path / f"{k}.ids.pt")
        refs[k] = (ref, logits(ref.model, ids))
        jobs[k] = {
            "dir": str(exports[k]),
            "batch": str(tmp_path / f"{k}.ids.pt"),
            "logits": str(tmp_path / f"{k}.logits.pt"),
        }
    r = run_without_gptop(PLAIN, json.dumps(jobs), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    for k, (ref, want) in refs.items():
        got = torch.load(tmp_path / f"{k}.logits.pt")
        assert torch.equal(got, want), f"{k}: max |diff| {(got - want).abs().max()}"
        s = seen[k]
        assert s["class"] == ("DeepseekV3ForCausalLM" if k == "deepseek" else "LlamaForCausalLM")
        assert s["ids"] == ref.tokenizer("def f(x):\n    return x")["input_ids"] and s["len"] == len(ref.tokenizer)
        assert s["is_causal"] is (k != "llada")
        assert s["mask"] == ref.tokenizer.mask_token_id
        if k == "llada":
            assert s["mask"] == ref.mask_id


@pytest.mark.process
@pytest.mark.slow
def test_gptop_sample_a_sharded_checkpoint_and_a_llada_export(all_runs, exports):
    """`gptop sample --json`: a result line from a causal run's sharded checkpoint, and from a llada export, which
    samples as llada, the text its run samples (each family's sampling in this process: test_sample_in_process;
    the command on a run's one-file checkpoint: tests/test_docs.py runs models.md's `gptop sample runs/llada` and
    `gptop sample runs/demo --json`)."""
    from trainer.export import load_for_inference
    from trainer.sample import generate

    targets = {"dcp": all_runs["dcp"], "llada-export": exports["llada"]}
    done = run_all(
        {
            k: gptop_cmd(
                "--no-ui",
                "sample",
                str(p),
                "--prompt",
                "import ",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
                "--json",
            )
            for k, p in targets.items()
        }
    )
    runs_of = {"dcp": all_runs["dcp"], "llada-export": all_runs["llada"]}  # the export samples what its run samples
    for k, r in done.items():
        assert r.returncode == 0, f"{k}: {r.stderr[-3000:]}"
        res = SampleResult.from_json(r.stdout.strip().splitlines()[-1])
        assert res.prompt == "import " and 0 <= res.new_tokens <= 8 and res.load_seconds > 0
        assert res.objective == ("llada" if k.startswith("llada") else "causal")
        if k == "dcp":
            assert res.step == 4 and res.source.endswith("step-00000004.dcp")
        else:
            assert res.step is None
        ns = sample_ns(runs_of[k], prompt="import ", max_new_tokens=8, temperature=0.0)
        loaded = load_for_inference(ns.path, tools.check_sample(ns), log=quiet)
        assert res.completion == generate(loaded, ns).completion  # the same text as the run's, in this process


@pytest.mark.process
@pytest.mark.slow
def test_gptop_train_fine_tunes_exports(exports, tmp_path):
    """`gptop train --model OUT_DIR` fine-tunes the export of a two-rank checkpoint; the trainer fine-tunes every
    family's export (in this process, while the command runs: the command's path is the same for every export),
    a llada export with the llada objective."""
    from trainer.train import EXIT_OK

    args = [*TINY, "--max-steps", "2"]
    command = start_gptop(
        "--no-ui",
        "train",
        "--model",
        str(exports["dcp"]),
        *args,
        "--run-dir",
        str(tmp_path / "dcp"),
        cwd=ROOT,
        env=gptop_env(**ONE_THREAD),
    )
    try:
        codes = {k: train_in_process(tmp_path / k, "--model", str(exports[k]), *args)[0] for k in FAMILIES}
    finally:
        err = command.communicate(timeout=300)[1]
    assert command.returncode == 0, err[-3000:]
    codes["dcp"] = command.returncode
    for k, code in codes.items():
        assert code == EXIT_OK, k
        events = [json.loads(line) for line in (tmp_path / k / "events.jsonl").read_text().splitlines()]
        hello = next(e for e in events if e["type"] == "hello" and not e.get("early"))
        assert hello["model"]["family"] == "pretrained"
        assert hello["model"]["objective"] == ("llada" if k == "llada" else "causal")
        losses = [e["loss"] for e in events if e["type"] == "step"]
        assert len(losses) == 2 and all(0 < x < 20 for x in losses)


@pytest.mark.process
@pytest.mark.slow
def test_export_force_never_touches_a_live_run(tmp_path):
    """`gptop export RUN runs/live --force` and `... runs/live/checkpoints --force` while runs/live trains: both
    exit 2 naming what OUT_DIR is, and the run goes on to a clean stop with every file it wrote."""
    live = tmp_path / "runs" / "live"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer",
            *TINY,
            "--max-steps",
            "100000",
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(live),
        ],
        cwd=ROOT,
        env=gptop_env(**ONE_THREAD),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not rundir.list_checkpoints(live):
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.stderr.read()[-3000:]
            time.sleep(0.2)
        done = run_all(
            {
                "run": gptop_cmd("--no-ui", "export", str(live), str(live), "--force"),
                "checkpoints": gptop_cmd("--no-ui", "export", str(live), str(live / "checkpoints"), "--force"),
                "parent": gptop_cmd("--no-ui", "export", str(live), str(live.parent) + "/", "--force"),
            },
            timeout=120,
        )
        for name, r in done.items():
            assert r.returncode == 2, f"{name}: {r.stderr}"
            assert "OUT_DIR" in r.stderr and "Traceback" not in r.stderr and "loading" not in r.stderr, r.stderr
        assert "live run" in done["run"].stderr and f"pid {trainer.pid}" in done["run"].stderr
        assert "checkpoints/ of the run" in done["checkpoints"].stderr and "holds" in done["parent"].stderr
        assert trainer.poll() is None  # still training
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    for name in ("config.toml", "events.jsonl"):
        assert (live / name).is_file()
    assert rundir.list_checkpoints(live) and not list(live.parent.glob(".*"))


@pytest.mark.process
@pytest.mark.slow
def test_a_killed_export_says_why_and_the_next_one_cleans_up(runs, tmp_path):
    """SIGKILL of the export worker (what the OOM killer does) while it writes: gptop exits 1 saying so;
    the next export into the same OUT_DIR removes the hidden temporary folder the killed one left."""
    import psutil

    from trainer.export import export

    out = tmp_path / "out"
    p = start_gptop("--no-ui", "export", str(runs["llama"]), str(out), cwd=ROOT, env=gptop_env(**ONE_THREAD))
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.export-*")):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and "the export was killed by signal 9 (SIGKILL)" in err, err
    assert "out of memory" in err and "Traceback" not in err
    assert list(tmp_path.glob(".out.export-*")) and not out.exists()
    # the next export (the export worker's code, in this process: the command's path to its end is the exports
    # fixture's) cleans up
    said: list[str] = []
    assert export(export_ns(runs["llama"], out), log=said.append)["step"] == 4
    assert any("left next to out by an export that was killed" in line for line in said), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
