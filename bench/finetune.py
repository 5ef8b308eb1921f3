"""Fine-tuning in small memory: full fine-tuning vs LoRA vs each optimizer, on the same model, in one run.

Builds one Hugging Face model directory (llama architecture, random weights, the builtin tokenizer;
`--hidden/--layers` set its size, default 34M parameters, big enough that the training state shows
in the process's memory) and fine-tunes it with each configuration for a few steps, one trainer
process each, in turn. Per configuration it reports:

- peak memory: the largest `mem_bytes` of the step events (on the CPU the process's peak resident set,
  VmHWM, reset every log interval; it includes the Python and torch runtime, about the same in every
  run; on CUDA the allocator's peak),
- optimizer state: `optim_state_bytes` of the last step event (what the moments occupy as stored),
- tokens/s: the median over the steps after the first two (warm-up, torch.compile of torchao's step),

and each figure as a ratio against full fine-tuning with AdamW measured in the same run. With `--rounds N`
every configuration runs once per round, in turn (so drift of a shared machine's load hits all alike), and
each figure is the median over the rounds.

    python bench/finetune.py [--rounds 1] [--steps 8] [--hidden 512] [--layers 8] [--seq-len 128] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS: list[tuple[str, list[str]]] = [
    ("full, adamw", ["--optimizer", "adamw"]),
    ("full, adamw-8bit", ["--optimizer", "adamw-8bit"]),
    ("full, adamw-4bit", ["--optimizer", "adamw-4bit"]),
    ("full, adafactor", ["--optimizer", "adafactor"]),
    ("lora 8, adamw", ["--lora", "8", "--optimizer", "adamw"]),
    ("lora 8, adamw-8bit", ["--lora", "8", "--optimizer", "adamw-8bit"]),
]


def make_model(out: Path, hidden: int, layers: int) -> int:
    """A llama model directory of the given width and depth with the builtin tokenizer; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.contract.config import DataConfig, ModelConfig, Toggles
    from trainer.contract.device import DeviceInfo
    from trainer.data import tokenizer_info
    from trainer.export import hf_tokenizer
    from trainer.models import build_model, pad_vocab

    tok = tokenizer_info(DataConfig(), log=lambda s: None)
    cfg = LlamaConfig(
        vocab_size=pad_vocab(tok.vocab_size),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        use_cache=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tiny = build_model(
        ModelConfig(model="llama", size="tiny"),
        vocab_size=tok.vocab_size,
        seq_len=64,
        toggles=Toggles(),
        dev=DeviceInfo(type="cpu", name="cpu"),
    )
    hf_tokenizer(tok, tiny, 2048).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def run(model: Path, extra: list[str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        argv = [
            sys.executable,
            "-m",
            "trainer",
            "--model",
            str(model),
            "--run-dir",
            d,
            "--max-steps",
            str(args.steps),
            "--log-every",
            "1",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--seq-len",
            str(args.seq_len),
            "--global-batch",
            str(args.batch),
            "--micro-batch",
            str(args.batch),
            "--warmup-steps",
            "2",
            "--lr",
            "1e-4",
            "--device",
            args.device,
            *extra,
        ]
        r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
        events = [json.loads(line) for line in (Path(d) / "events.jsonl").read_text().splitlines()]
    hello = next(e for e in events if e["type"] == "hello")
    steps = [e for e in events if e["type"] == "step"]
    return {
        "peak": max(e["mem_bytes"] for e in steps),
        "optim": steps[-1].get("optim_state_bytes"),
        "tps": statistics.median(e["tokens_per_s"] for e in steps[2:]),
        "trainable": hello["model"]["trainable_params"],
        "loss": steps[-1]["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "model"
        n = make_model(model, args.hidden, args.layers)
        print(
            f"model: llama {args.hidden} x {args.layers} layers, {n / 1e6:.1f}M params; seq {args.seq_len}, "
            f"batch {args.batch}, {args.steps} steps, {args.device}",
            flush=True,
        )
        rounds: dict[str, list[dict]] = {name: [] for name, _ in CONFIGS}
        for i in range(args.rounds):
            for name, extra in CONFIGS:
                rounds[name].append(run(model, extra, args))
                print(f"  round {i + 1}, {name}: {rounds[name][-1]}", flush=True)
    results = {}
    for name, rs in rounds.items():
        ok = [r for r in rs if "error" not in r]
        results[name] = {k: statistics.median(r[k] for r in ok) for k in ok[0]} if ok else rs[0]
    base = results[CONFIGS[0][0]]
    mib = 1 << 20
    print(
        "\n| configuration | trainable params | peak memory | x full | optimizer state | x full | tokens/s | x full |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, _ in CONFIGS:
        r = results[name]
        if "error" in r:
            print(f"| {name} | failed: {r['error']} |||||||")
            continue
        print(
            f"| {name} | {r['trainable'] / 1e6:.2f}M | {r['peak'] / mib:.0f} MiB | {r['peak'] / base['peak']:.2f} "
            f"| {r['optim'] / mib:.1f} MiB | {r['optim'] / base['optim']:.3f} | {r['tps']:.0f} "
            f"| {r['tps'] / base['tps']:.2f} |"
        )


if __name__ == "__main__":
    main()
