"""docs/models.md: the families' table of sizes and parameter counts, and the prose on fine-tuning in small
memory and using a trained model (`python -m trainer.models_guide > docs/models.md`; a test keeps them equal)."""

from __future__ import annotations

from .contract.common import FAMILIES
from .models import DEFAULT_VOCAB, SIZE_ORDER, SIZES, param_counts

# The fine-tuning part of docs/models.md (trainer.lora, trainer.optim and trainer.flops implement it).
FINETUNING = """\
## Fine-tuning in small memory: LoRA, QLoRA, low-bit optimizers

Full fine-tuning trains every weight and keeps fp32 AdamW moments: 16 bytes per
parameter before activations. Three options cut that, alone or together:

- `--lora R` trains rank-R LoRA adapters (peft, Hu et al. 2021) on a frozen base,
  for a model directory or a built-in family. `--lora-alpha` (16) scales the
  update by alpha / R, `--lora-dropout` (0) drops the adapters' input,
  `--lora-targets` picks the layers: `auto` takes the attention and MLP
  projections the architecture has (llama: q, k, v, o, gate, up, down;
  deepseek: q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, and for the MLP
  names peft (0.21 with transformers 5, as installed) adapts the fused routed-expert tensors,
  gate_up_proj at rank 2R, leaving the dense and shared-expert MLPs frozen), or
  give names (`q_proj,v_proj`); a name the model lacks is refused with the
  names it has. Checkpoints hold only the adapters and their optimizer state,
  also the sharded ones of several DDP ranks (`--nproc N`; LoRA with
  `--parallel fsdp` is refused); the base is rebuilt from its directory or the
  family's seeded initialization, and resume is exact (tests/test_lora.py, and
  two ranks in tests/test_distributed.py). The dashboard shows trainable vs total parameters.
- `--optimizer adamw|adamw-8bit|adamw-4bit|adafactor`: torch's AdamW (fp32
  moments, 8 bytes per trained parameter), torchao's `AdamW8bit` / `AdamW4bit`
  (block-wise quantized moments; tensors under 4096 values keep fp32 ones;
  the update runs through torch.compile, so they need a C++ compiler on the
  CPU or triton on a GPU), or `torch.optim.Adafactor` (a factored second
  moment, no first moment; its `--lr` is relative: capped by 1/sqrt(step) and
  scaled by each weight's RMS). Step events carry `optim_state_bytes`, what the
  state really occupies, and the dashboard shows it beside the memory. The
  optimizer is a toggle the tuner may trade for memory (docs/tuning.md), so a
  run resumes from a checkpoint of another optimizer: the AdamW variants'
  moments carry over (dequantized, then stored as the new one stores them),
  Adafactor's state converts to nothing and the new optimizer starts fresh (a
  warning says which). With several ranks a checkpoint resumes only with the
  optimizer that wrote it.
- The estimate a run prints before it builds anything counts these choices from
  the shapes (`trainer/contract/estimate.py`): fp32 weights, 4-byte gradients
  and the optimizer's state of the trained tensors only (adamw 8 B per
  parameter; adamw-8bit / adamw-4bit about 2.03 / 1.06 B: codes, one fp32 scale
  per 256 / 128 values and a code table; adafactor 4 B x (rows + columns) per
  matrix), a quantized base's linear layers at 0.52 B (nf4) / 1 B (int8) per
  weight, and shows the optimizer's part: `~0.8 GiB (optimizer 23 MiB)`. The
  optimizer state of the built tiny models after a step matches it exactly
  (`tests/test_estimate.py`).
- `--quantize-base nf4|int8` (QLoRA, needs `--lora` and a model directory):
  the frozen base is loaded through bitsandbytes (nf4: 4-bit NormalFloat with
  double quantization, compute dtype from `--precision`; int8: LLM.int8()),
  the adapters stay fp32. It needs CUDA and `pip install 'gptop[qlora]'`;
  anywhere else the trainer exits 2 naming `--quantize-base` and the reason.
  `gptop doctor`'s `qlora` check ran on an H100 (2026-11-27, bitsandbytes
  0.50.2: a tiny transformers model with an nf4 base and LoRA adapters trained
  a step, the adapters changed and the base did not; docs/verified.md), and
  so did whole runs from an exported model directory (`bench/gpu_paths.sh`:
  nf4 for 20 steps and its resume to 30, int8 for 20). It is a
  toggle too: a memory-constrained tuning of a LoRA run may try it, resuming
  the adapters on a base quantized differently (the adapters are the same
  tensors; verified only against peft's documentation).
- `--optimizer` and `--quantize-base` are in the config's `[toggles]` table
  (they were in `[optim]` and `[finetune]`; a file with them there still
  reads, and a file giving both places must agree).

```bash
gptop train --model ./my-model --lora 16 --optimizer adamw-8bit
gptop export runs/<run> hf/adapter            # peft format: adapter_config.json + adapter_model.safetensors
gptop export runs/<run> hf/merged --merge     # the base with the adapters merged: a plain model
```

FLOPs and MFU stay honest with a frozen base: a frozen weight needs the forward
(2 FLOPs per parameter and token) and the gradient of its input (2) but no
weight gradient, so a LoRA run counts `6 * N_adapters + 4 * N_frozen` plus the
attention term (trainer.flops cites the backward = 2 x forward split of
Narayanan et al. 2021, arXiv:2104.04473). Full fine-tuning is `6 * N` as before.

"""


# The export and sample part of docs/models.md (trainer.export and trainer.sample implement it).
USING_A_MODEL = """\
## A model you can use: export and sample

`gptop export RUN_DIR OUT_DIR` writes a run's checkpoint as a Hugging Face model
directory: `model.safetensors` (fp32), `config.json`, `generation_config.json`
and the tokenizer (`tokenizer.json`, `tokenizer_config.json`). It takes the
newest checkpoint that loads (`--step N` for another), one-file or sharded
(a `.dcp/` written by several ranks, read in one process). OUT_DIR must be new or
empty; `--force` replaces an earlier export and nothing else. The export's
`gptop-export.json` lists every file it wrote, and `--force` refuses (exit 2, before
anything loads, naming what it is) a run directory (live or finished, also one
stopped before its first step), a folder that holds a run at any depth, a run's
`checkpoints/` or anything inside it, the current directory or a folder holding it,
and a directory with files export did not write, however the path is spelled
(symlinks, `..`, a trailing slash): the one rule is `trainer/contract/protect.py`.
The directory is written under a temporary name, read back with transformers and
compared with the checkpoint (logits on a batch, token ids of a text), and only then
renamed into place (an earlier export is removed only after that); an export that
was killed leaves OUT_DIR as it was, and the next export into it removes its
temporary folder. `--json` prints the result as one JSON line; progress goes to stderr.

```bash
gptop --no-ui train --model llama --size tiny --max-steps 200 --run-dir runs/demo
gptop export runs/demo hf/demo
```

Plain transformers loads it, no gptop needed:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model, tok = AutoModelForCausalLM.from_pretrained("hf/demo"), AutoTokenizer.from_pretrained("hf/demo")
print(tok.decode(model.generate(**tok("def main(", return_tensors="pt"), max_new_tokens=20)[0]))
```

The exported model is the same class (`LlamaForCausalLM`, `DeepseekV3ForCausalLM`)
with the same fp32 weights, so on the same device its logits equal the
checkpoint's bit for bit (the tests check this for every family and for a
two-rank checkpoint, in a Python that cannot import gptop); another device or
thread count may differ within fp32 rounding. `config.json` also records where
the model came from (`"gptop": {"family", "size", "objective", "step", ...}`).
`gptop train --model hf/demo` fine-tunes the export (its own tokenizer, offline).
The builtin tokenizer is rebuilt from this Python's standard library, so export
with the Python and environment (`GPTOP_BUILTIN_BYTES`) the run trained with: an
export that would get another tokenizer stops with an error.

A LoRA run (`--lora`) exports its adapter in peft's format: `adapter_config.json`,
`adapter_model.safetensors`, the tokenizer and a `README.md` with the lines that
load it. `base_model_name_or_path` is the model directory the run fine-tuned
(absolute), or, for a built-in family whose base exists only as the run's
initialization, `base`: the copy in `OUT_DIR/base`, written relative so that a
copied or moved export keeps its own base. peft resolves a relative base against
the working directory, so `AutoPeftModelForCausalLM.from_pretrained(".")` loads the
export from inside it; from anywhere,
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT_DIR + "/base"), OUT_DIR)`.
`gptop sample` takes an adapter export directory too: it loads the export's own base
(or the model directory it names) and refuses a base whose fingerprint differs from
the one recorded at export (`gptop-export.json`), so an export never binds silently
to another base (a re-export to the original place, a replaced model directory). With `--merge`
it writes the base with the adapters merged in (`merge_and_unload`), which plain
`AutoModelForCausalLM` loads; its logits match the adapted model's within fp32
rounding of the merge. Both are read back and compared before they are moved into
place. A run with a quantized base (`--quantize-base`) cannot be exported yet.

`gptop sample RUN_DIR --prompt TEXT` prints the prompt and its continuation from
the newest checkpoint (`--step N`), or from an exported directory. Options:
`--max-new-tokens` (64), `--temperature` (0.8; 0 is greedy, and so is anything
below 1e-30, where logits / T would overflow float32), `--seed` (0),
`--timeout` (120 s for the whole process, generation keeps what it has at the
deadline), `--device` (cpu, so a training run's GPU memory is left alone),
`--json` (one line: the completion, token count, why it stopped, timings). It
runs in its own short-lived process, like export; the dashboard's `s` key runs
one on the newest checkpoint while training goes on ([dashboard.md](dashboard.md)).

```bash
gptop sample runs/demo --prompt "def main(" --max-new-tokens 32
gptop sample runs/demo --prompt "def main(" --temperature 0 --json
```

The prompt follows the end-of-text token (documents are separated by it in
training), so it reads as the start of a document; an empty prompt is an
unconditional sample. llama and deepseek generate with transformers' `generate`
(the full distribution at temperature T, no top-k or top-p), until end-of-text
or `--max-new-tokens`.

### llada

A llada export is a `LlamaForCausalLM` whose `config.json` says
`"is_causal": false` and `"mask_token_id"`, and whose tokenizer has that id as
its mask token (`<|mask|>`). Loading it back, gptop restores both:
`gptop train --model hf/llada` keeps the attention bidirectional and trains with
the llada objective and the model's mask token. Plain transformers 5 (tested
with 5.23) reads `is_causal` from the config and attends bidirectionally, so
`AutoModelForCausalLM` gives the trained model's logits; what it predicts at a
position is the token that belongs *there* when that position holds the mask
token, not the next token. `model.generate()` therefore produces nothing
meaningful for it (and transformers versions that ignore `is_causal` even run
it with causal attention, which is not the model that was trained): sample it
with `gptop sample`, or with the reverse process below.

```bash
gptop --no-ui train --model llada --size tiny --max-steps 200 --run-dir runs/llada
gptop export runs/llada hf/llada
gptop sample runs/llada --prompt "def main(" --max-new-tokens 32 --diffusion-steps 16
gptop --no-ui train --model hf/llada --max-steps 100 --run-dir runs/llada-tuned
```

`gptop sample` on a llada model runs the reverse process of LLaDA with
low-confidence remasking (Nie et al. 2025, "Large Language Diffusion Models",
arXiv:2502.09992, Algorithm 5). The completion of L = `--max-new-tokens` tokens
starts fully masked after the prompt. Each of the N = `--diffusion-steps`
reverse steps (default L) goes from time t to s = t - 1/N: the model predicts
every masked position at once; the prediction of a position is its most likely
token (temperature 0) or a draw from softmax(logits / T), and its confidence is
the probability of that token; the most confident predictions are kept so that
floor(L (1 - s)) completion tokens are unmasked after the step, and the rest are
masked again. The mask token and the padded part of the vocabulary are never
generated. The completion ends at its first end-of-text token.

"""


def model_table(vocab_size: int = DEFAULT_VOCAB) -> list[dict]:
    """Every family and size with total and active parameters (for the README)."""
    rows = []
    for family in FAMILIES:
        for size in SIZE_ORDER:
            c = param_counts(family, size, vocab_size)
            d = SIZES[size]
            rows.append(
                {
                    "family": family,
                    "size": size,
                    "total": c["total"],
                    "active": c["active"],
                    "embedding": c["embedding"],
                    "hidden": d.hidden,
                    "layers": d.layers,
                    "heads": d.heads,
                }
            )
    return rows


def model_table_markdown(vocab_size: int = DEFAULT_VOCAB) -> str:
    """`model_table` as a markdown table."""

    def m(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    lines = [
        "| family | size | hidden × layers, heads | total params | active params / token |",
        "|---|---|---|---:|---:|",
    ]
    for r in model_table(vocab_size):
        lines.append(
            f"| {r['family']} | {r['size']} | {r['hidden']} × {r['layers']}, {r['heads']} "
            f"| {m(r['total'])} | {m(r['active'])} |"
        )
    return "\n".join(lines)


def models_markdown() -> str:
    """The README section on models (docs/models.md is this output; a test keeps them equal)."""
    return f"""## Models

`--model` takes a family or a local Hugging Face model directory; `--size` takes
tiny, small, medium, large or auto. Every family is a stock transformers
architecture trained from random initialization.

- **llama**: `LlamaForCausalLM`, next-token prediction.
- **deepseek**: `DeepseekV3ForCausalLM`: multi-head latent attention and a
  routed mixture of experts ({SIZES["small"].experts} experts in {SIZES["small"].groups} groups, \
top-{SIZES["small"].top_k} within the best {SIZES["small"].topk_groups}
  groups, plus {SIZES["small"].shared} shared expert; tiny: {SIZES["tiny"].experts} experts, \
top-{SIZES["tiny"].top_k}; the first layer is
  dense), balanced without an auxiliary loss by the DeepSeek-V3 bias update.
  Sizes match llama in *active* parameters per token.
- **llada**: the llama architecture with bidirectional attention, trained with
  the LLaDA masked-diffusion objective.
- **a directory** (`--model ./my-model`): fine-tunes that model from its weights
  with its own tokenizer.

Parameter counts with the builtin {DEFAULT_VOCAB}-token tokenizer (each further
vocabulary entry adds `2 × hidden` parameters; llada adds a mask token):

{model_table_markdown()}

`--size auto` picks `tiny` on a CPU (`small` with 32+ cores and 64+ GiB), and on
a GPU `small` under 12 GiB, `medium` under 40 GiB, else `large`, stepping down
while the run's persistent training state of the *total* parameters would exceed 60%
of the GPU memory: 16 bytes per parameter for full AdamW training (fp32 weights,
gradients and two moments), less with `--optimizer adamw-8bit|adamw-4bit|adafactor`
or `--lora R`, counted by the same formula as the first run's estimate
(`trainer.contract.estimate.state_bytes`). So on a 16 GiB GPU deepseek steps down
to `small` with AdamW and keeps `medium` with `--optimizer adamw-8bit`.

{FINETUNING}
{USING_A_MODEL}
Generated by `python -m trainer.models_guide`.
"""


if __name__ == "__main__":  # python -m trainer.models_guide > docs/models.md
    print(models_markdown(), end="")
