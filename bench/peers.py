"""gptop's trainer against its peers: a plain PyTorch loop and Hugging Face `transformers.Trainer`.

Every contender trains the same model (trainer.models.build_model, same seed, so the
same initial weights), on the same token batches in the same order
(trainer.batches.BatchSampler), with the same global batch, sequence length, AdamW
hyperparameters (betas 0.9/0.95, eps 1e-8, the same weight-decay groups), gradient
clipping, a constant learning rate (no warm-up, no decay: the one schedule every
contender can express identically) and the same number of steps:

  plain        a minimal hand-written loop: torch.optim.AdamW with torch's defaults, clip, nothing else
  hf           transformers.Trainer with default arguments
  hf-fast      transformers.Trainer with its documented speed arguments for the device
               (torch_compile, bf16 where the device supports it, fused AdamW)
  gptop        `python -m trainer` with default toggles
  gptop-tuned  `python -m trainer --config best.toml`: the toggles `gptop tune` found

Each contender runs in a fresh subprocess per round, and rounds alternate the
contenders (A B C D E, A B C D E, ...) so that drift on a shared machine hits all
alike. Every process uses the same number of torch threads (--threads, default 1; set
through OMP_NUM_THREADS and torch.set_num_threads): on a shared machine, two OpenMP threads on
two cores stall at every parallel region's barrier whenever another process takes a core, which
made 2-thread runs here swing 10x between rounds; one thread measures per-core efficiency stably.

Throughput is measured per interval of --log-every steps, from the end of one
interval to the end of the next (everything a step costs is inside: data, forward,
backward, optimizer, logging, the loss read-back), the first --warmup steps
excluded (compilation, allocator and caches). The table shows the median tokens/s
over all steady intervals of all rounds, the spread (min-max) of the per-round
medians, and the ratios to plain and to hf as the median over rounds of the ratio
within each round (contenders of a round ran minutes apart, so load drift between
rounds cancels). Peak memory: the process's peak RSS on the CPU, torch.cuda.max_memory_allocated
on a GPU. Loss: the mean training loss of the last interval (the same steps for all),
so that a speedup which breaks training shows.

    python bench/peers.py                              # CPU defaults, < 15 min on 2 cores
    python bench/peers.py --tuned runs/x/best.toml     # tuned toggles from a tuning run
    python bench/peers.py --tune 3m                    # tune first (gptop tune --tune-only)
    python bench/peers.py --device cuda --size small   # GPU edition: adds MFU

Without --tuned or --tune, the tuned toggles come from bench/tuned/<device>-<model>-<size>.toml
(<device>: cuda, or cpu-<vector ISA>, e.g. cpu-avx2, cpu-avx512) when that file exists (written by
an earlier `--tune` on this kind of machine), else the gptop-tuned contender is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
CONTENDERS = ("plain", "hf", "hf-fast", "gptop", "gptop-tuned")


@dataclass
class Spec:
    """What every contender trains: the same for all."""

    model: str = "llama"
    size: str = "tiny"
    seq_len: int = 128
    global_batch: int = 16
    micro_batch: int = 16  # for plain and HF (gptop picks its own: default `auto`, or the tuned one)
    steps: int = 25
    warmup: int = 5
    log_every: int = 5
    lr: float = 1e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    device: str = "cpu"
    threads: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class RunResult:
    """One contender in one round."""

    contender: str
    round: int
    intervals: list[dict[str, Any]] = field(default_factory=list)  # {"end_step", "tokens_per_s", "loss"}
    peak_mem: int | None = None
    wall_s: float | None = None
    error: str | None = None
    note: str | None = None


# ----------------------------------------------------------------------------------- workers
# These run inside the fresh subprocess of one contender.


def _setup(spec: Spec):
    import torch

    torch.set_num_threads(spec.threads)
    sys.path.insert(0, str(ROOT))
    from trainer.contract.config import DataConfig, ModelConfig, Toggles
    from trainer.batches import BatchSampler
    from trainer.data import load_data
    from trainer.device_probe import detect
    from trainer.models import build_model

    dev = detect(spec.device)
    data = load_data(DataConfig(seq_len=spec.seq_len), log=lambda m: None)
    sampler = BatchSampler(data.train, spec.seq_len, spec.global_batch, spec.seed)
    torch.manual_seed(spec.seed)
    bundle = build_model(
        ModelConfig(model=spec.model, size=spec.size),
        vocab_size=data.vocab_size,
        seq_len=spec.seq_len,
        toggles=Toggles(),
        dev=dev,
        mask_id=data.mask_id,
        seed=spec.seed,
    )
    return dev, sampler, bundle


def _sync(dev) -> None:
    if dev.is_cuda:
        import torch

        torch.cuda.synchronize(dev.torch_device)


def _peak_mem(dev) -> int | None:
    if dev.is_cuda:
        import torch

        return int(torch.cuda.max_memory_allocated(dev.torch_device))
    return None  # the parent reads the child's peak RSS from wait4


def _intervals(spec: Spec, ends: dict[int, float], losses: dict[int, float]) -> list[dict[str, Any]]:
    """Per-interval tokens/s from the wall time at the end of every log step (steps 1-based)."""
    out = []
    for s in sorted(ends):
        prev = s - spec.log_every
        if prev < spec.warmup or prev not in ends:
            continue
        dt = ends[s] - ends[prev]
        out.append({"end_step": s, "tokens_per_s": spec.log_every * spec.tokens_per_step / dt, "loss": losses.get(s)})
    # The last interval's loss is reported even when it is inside warm-up (tiny runs).
    if out == [] and losses:
        s = max(losses)
        out.append({"end_step": s, "tokens_per_s": None, "loss": losses[s]})
    return out


def worker_plain(spec: Spec) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    dev, sampler, bundle = _setup(spec)
    from trainer.optim import BETAS, EPS, param_groups  # gptop's weight-decay groups and AdamW constants

    model = bundle.model.to(dev.torch_device)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=BETAS, eps=EPS)
    accum = spec.global_batch // spec.micro_batch
    ends: dict[int, float] = {}
    losses: dict[int, float] = {}
    interval: list[torch.Tensor] = []
    _sync(dev)
    ends[0] = time.perf_counter()
    for step in range(spec.steps):
        total = torch.zeros((), device=dev.torch_device)
        for k in range(accum):
            x, y = sampler.micro_batch(step, k, spec.micro_batch)
            x, y = x.to(dev.torch_device, non_blocking=True), y.to(dev.torch_device, non_blocking=True)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        interval.append(total)
        if (step + 1) % spec.log_every == 0:
            losses[step + 1] = torch.stack(interval).mean().item()  # the one read-back per interval
            interval = []
            ends[step + 1] = time.perf_counter()
    return {"intervals": _intervals(spec, ends, losses), "peak_mem": _peak_mem(dev)}


def hf_speed_args(dev) -> dict[str, Any]:
    """transformers' documented speed arguments for the device (what a user would turn on)."""
    import torch

    args: dict[str, Any] = {"torch_compile": True, "optim": "adamw_torch_fused"}
    if dev.is_cuda:
        if torch.cuda.is_bf16_supported():
            args["bf16"] = True
        if dev.at_least(8, 0):
            args["tf32"] = True
    elif dev.cpu_bf16:
        args["bf16"] = True  # CPU autocast to bf16: worth it only where oneDNN has bf16 kernels (AVX-512+)
    return args


def worker_hf(spec: Spec, fast: bool) -> dict[str, Any]:
    import torch

    dev, sampler, bundle = _setup(spec)
    from trainer.models import quiet_imports
    from trainer.optim import BETAS, EPS, decays

    with quiet_imports():
        from transformers import Trainer, TrainerCallback, TrainingArguments

    class Sequences(torch.utils.data.IterableDataset):
        """Exactly the sequences of the other contenders, in their order (no shuffling)."""

        def __iter__(self):
            for step in range(spec.steps + 1):  # one spare step: the dataloader may look ahead
                x, y = sampler.micro_batch(step, 0, spec.global_batch)
                for i in range(spec.global_batch):
                    # shift_labels: y is already the next token of x (the loss must not shift again)
                    yield {"input_ids": x[i], "labels": y[i], "shift_labels": y[i]}

    ends: dict[int, float] = {}
    losses: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            _sync(dev)
            ends[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % spec.log_every == 0:
                _sync(dev)
                ends[state.global_step] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    class SameDecayTrainer(Trainer):
        # Only the weight-decay grouping is made the same as gptop's (HF also decays the embeddings);
        # nothing on the speed path changes.
        def get_decay_parameter_names(self, model) -> list[str]:
            return [n for n, p in model.named_parameters() if decays(n, p)]

    out = tempfile.mkdtemp(prefix="peers-hf-")
    kwargs: dict[str, Any] = dict(
        output_dir=out,
        max_steps=spec.steps,
        per_device_train_batch_size=spec.micro_batch,
        gradient_accumulation_steps=spec.global_batch // spec.micro_batch,
        learning_rate=spec.lr,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=spec.weight_decay,
        max_grad_norm=spec.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        seed=spec.seed,
        logging_steps=spec.log_every,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=not dev.is_cuda,
        # Keep `shift_labels` (not in the model's signature, so the default would drop it and the loss would
        # shift the already shifted targets again); a column filter, nothing on the speed path.
        remove_unused_columns=False,
    )
    if fast:
        kwargs.update(hf_speed_args(dev))
    args = TrainingArguments(**kwargs)
    trainer = SameDecayTrainer(model=bundle.model, args=args, train_dataset=Sequences(), callbacks=[Clock()])
    trainer.train()
    return {
        "intervals": _intervals(spec, ends, losses),
        "peak_mem": _peak_mem(dev),
        "note": ", ".join(f"{k}={v}" for k, v in hf_speed_args(dev).items()) if fast else None,
    }


def worker_main(name: str, spec: Spec, out: Path) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    try:
        if name == "plain":
            res = worker_plain(spec)
        elif name in ("hf", "hf-fast"):
            res = worker_hf(spec, fast=name == "hf-fast")
        else:
            raise ValueError(name)
        res["wall_s"] = time.perf_counter() - t0
    except Exception as e:  # reported in the table, not fatal to the benchmark
        import traceback

        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    out.write_text(json.dumps(res))


# ------------------------------------------------------------------------------------ parent


def child_env(spec: Spec) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(spec.threads)
    env["MKL_NUM_THREADS"] = str(spec.threads)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def spawn(argv: list[str], spec: Spec, log: Path, timeout: float) -> tuple[int, int, float]:
    """Run a child to the end; (exit code, peak RSS in bytes, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        p = subprocess.Popen(argv, cwd=ROOT, env=child_env(spec), stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                pid, status, usage = os.wait4(p.pid, 0)
                status = 124 << 8
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status) if status != 124 << 8 else 124
    return p.returncode, int(usage.ru_maxrss) * 1024, time.perf_counter() - t0


def gptop_argv(spec: Spec, run_dir: Path, tuned: Path | None) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "trainer",
        "--model",
        spec.model,
        "--size",
        spec.size,
        "--seq-len",
        str(spec.seq_len),
        "--global-batch",
        str(spec.global_batch),
        "--max-steps",
        str(spec.steps),
        "--lr",
        str(spec.lr),
        "--warmup-steps",
        "0",
        "--min-lr-ratio",
        "1",
        "--weight-decay",
        str(spec.weight_decay),
        "--grad-clip",
        str(spec.grad_clip),
        "--seed",
        str(spec.seed),
        "--log-every",
        str(spec.log_every),
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--device",
        spec.device,
        "--run-dir",
        str(run_dir),
    ]
    if tuned is not None:
        argv[3:3] = ["--config", str(tuned)]
        mb = _toml_toggles(tuned).get("micro_batch", "auto")
        if str(mb).isdigit() and spec.global_batch % int(mb):
            argv += ["--micro-batch", "auto"]  # tuned on another batch: its micro-batch does not divide this one
    return argv


def run_contender(name: str, rnd: int, spec: Spec, tuned: Path | None, work: Path, timeout: float) -> RunResult:
    res = RunResult(name, rnd)
    log = work / f"{name}-{rnd}.log"
    if name.startswith("gptop"):
        run_dir = work / f"{name}-{rnd}"
        code, rss, wall = spawn(gptop_argv(spec, run_dir, tuned if name == "gptop-tuned" else None), spec, log, timeout)
        res.wall_s = wall
        events = []
        ev_path = run_dir / "events.jsonl"
        if ev_path.is_file():
            events = [json.loads(line) for line in ev_path.read_text().splitlines() if line.strip()]
        steps = [e for e in events if e.get("type") == "step"]
        if code != 0:
            errs = [e["message"] for e in events if e.get("type") == "error"]
            res.error = f"exit {code}: {errs[0] if errs else 'see ' + str(log)}"
            return res
        for e in steps:
            first = e["step"] - e.get("interval_steps", spec.log_every)
            if first >= spec.warmup:
                res.intervals.append({"end_step": e["step"], "tokens_per_s": e["tokens_per_s"], "loss": e["loss"]})
        if not res.intervals and steps:
            res.intervals.append({"end_step": steps[-1]["step"], "tokens_per_s": None, "loss": steps[-1]["loss"]})
        hello = next((e for e in events if e.get("type") == "hello"), {})
        mb = hello.get("micro_batch")
        res.note = f"micro-batch {mb}" if mb else None
        if spec.device.startswith("cuda"):
            res.peak_mem = max((e.get("mem_bytes") or 0 for e in steps), default=None)
        else:
            res.peak_mem = rss
        return res
    out = work / f"{name}-{rnd}.json"
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--spec",
        json.dumps(asdict(spec)),
        "--out",
        str(out),
    ]
    code, rss, wall = spawn(argv, spec, log, timeout)
    res.wall_s = wall
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        data = {"error": f"exit {code}, no result; see {log}"}
    if data.get("error"):
        res.error = data["error"]
        return res
    res.intervals = data["intervals"]
    res.peak_mem = data.get("peak_mem") if spec.device.startswith("cuda") else rss
    res.note = data.get("note")
    return res


# ------------------------------------------------------------------------------ tuned toggles


def default_tuned_path(spec: Spec) -> Path:
    """Tuned toggles per kind of device: CUDA, or the CPU's vector ISA as torch sees it (avx2, avx512, ...),
    since what wins differs (bf16 is native on AVX-512 CPUs with AVX512_BF16, emulated on AVX2 ones)."""
    if spec.device.startswith("cuda"):
        kind = "cuda"
    else:
        import torch

        kind = "cpu-" + torch.backends.cpu.get_cpu_capability().lower().replace(" ", "")
    return TUNED_DIR / f"{kind}-{spec.model}-{spec.size}.toml"


def run_tune(spec: Spec, budget: str, work: Path) -> Path | None:
    """`gptop --no-ui tune --tune-only` on the benchmark's setup; returns its best.toml."""
    run_dir = work / "tune"
    # A study of its own: a shared study would mix in trials measured with another thread count or load.
    argv = [
        sys.executable,
        "-m",
        "gptop",
        "--no-ui",
        "tune",
        "--budget",
        budget,
        "--tune-only",
        "--storage",
        f"sqlite:///{work / 'study.db'}",
        *gptop_argv(spec, run_dir, None)[3:],
    ]
    # The tune needs room to measure trials: enough steps for the budget; the lr stays constant.
    i = argv.index("--max-steps")
    argv[i + 1] = "100000"
    print(f"tuning: {' '.join(argv[1:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=child_env(spec), stdout=open(work / "tune.log", "wb"), stderr=subprocess.STDOUT)
    best = run_dir / "best.toml"
    print(
        f"tuning took {time.perf_counter() - t0:.0f} s; best.toml {'written' if best.is_file() else 'missing'}",
        flush=True,
    )
    if not best.is_file():
        return None
    dest = default_tuned_path(spec)
    dest.parent.mkdir(parents=True, exist_ok=True)
    md = run_dir / "tuning.md"
    shown = [
        a
        for i, a in enumerate(argv[3:], 3)
        if a not in ("--run-dir", "--storage") and argv[i - 1] not in ("--run-dir", "--storage")
    ]
    header = f"# from: OMP_NUM_THREADS={spec.threads} gptop {' '.join(shown)}\n# on: {machine_line(spec)}\n"
    dest.write_text(header + best.read_text())
    if md.is_file():
        (dest.with_suffix(".md")).write_text(md.read_text())
    return dest


# ------------------------------------------------------------------------------------ report


def machine_line(spec: Spec) -> str:
    import torch

    if spec.device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        sys.path.insert(0, str(ROOT))
        from trainer.contract.device import cpu_name

        dev = f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores"
    import psutil

    return (
        f"{dev}; {psutil.virtual_memory().total / 2**30:.0f} GiB RAM; {spec.threads} torch threads; "
        f"torch {torch.__version__}; transformers {_version('transformers')}; Python {platform.python_version()}"
    )


def _version(mod: str) -> str:
    from importlib.metadata import version

    try:
        return version(mod)
    except Exception:
        return "?"


def summarize(
    results: list[RunResult], spec: Spec, flops_per_token: float | None, peaks: dict[str, float | None]
) -> list[dict[str, Any]]:
    rows = []
    for name in dict.fromkeys(r.contender for r in results):
        runs = [r for r in results if r.contender == name]
        ok = [r for r in runs if not r.error]
        tps = [i["tokens_per_s"] for r in ok for i in r.intervals if i["tokens_per_s"]]
        by_round = {
            r.round: statistics.median(v)
            for r in ok
            if (v := [i["tokens_per_s"] for i in r.intervals if i["tokens_per_s"]])
        }
        per_round = list(by_round.values())
        last_losses = [r.intervals[-1]["loss"] for r in ok if r.intervals and r.intervals[-1].get("loss") is not None]
        mems = [r.peak_mem for r in ok if r.peak_mem]
        row = {
            "contender": name,
            "rounds": len(ok),
            "errors": [r.error for r in runs if r.error],
            "tokens_per_s": statistics.median(tps) if tps else None,
            "spread": (min(per_round), max(per_round)) if per_round else None,
            "intervals": len(tps),
            "loss": statistics.median(last_losses) if last_losses else None,
            "loss_step": ok[0].intervals[-1]["end_step"] if ok and ok[0].intervals else None,
            "peak_mem": max(mems) if mems else None,
            "note": next((r.note for r in ok if r.note), None),
            "per_round": by_round,
        }
        peak = peaks.get(name)
        row["mfu"] = (
            row["tokens_per_s"] * flops_per_token / peak if row["tokens_per_s"] and flops_per_token and peak else None
        )
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], show_mfu: bool) -> str:
    by = {r["contender"]: r for r in rows}
    base_plain, base_hf = by.get("plain"), by.get("hf")

    def ratio(row, base):
        """Median over rounds of this round's ratio: contenders of one round ran minutes apart, so a drift
        of the machine's load between rounds cancels out."""
        if not row or not base:
            return "-"
        pairs = [row["per_round"][k] / base["per_round"][k] for k in row["per_round"] if k in base["per_round"]]
        return f"{statistics.median(pairs):.2f}x" if pairs else "-"

    head = [
        "contender",
        "tokens/s (median)",
        "spread (round medians)",
        "vs plain",
        "vs hf default",
        "loss @ step",
        "peak mem",
    ]
    if show_mfu:
        head.insert(3, "MFU")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        if r["tokens_per_s"] is None:
            why = "; ".join(r["errors"]) or r.get("note") or "no steady interval"
            lines.append(f"| {r['contender']} | failed: {why} |" + " |" * (len(head) - 2))
            continue
        lo, hi = r["spread"]
        cells = [
            r["contender"],
            f"{r['tokens_per_s']:,.0f}",
            f"{lo:,.0f} - {hi:,.0f}",
            ratio(r, base_plain),
            ratio(r, base_hf),
            f"{r['loss']:.4f} @ {r['loss_step']}" if r["loss"] is not None else "-",
            f"{r['peak_mem'] / 2**30:.2f} GiB" if r["peak_mem"] else "-",
        ]
        if show_mfu:
            cells.insert(3, f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['contender']}: {r['note']}" for r in rows if r.get("note")]
    notes += [
        f"- {r['contender']}: {len(r['errors'])} failed round(s): {r['errors'][0]}"
        for r in rows
        if r["errors"] and r["tokens_per_s"] is not None
    ]
    return "\n".join(lines + ([""] + notes if notes else []))


def model_flops(spec: Spec) -> tuple[float | None, dict[str, float | None]]:
    """FLOPs per token of the model and the MFU peak per contender (trainer.flops)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from trainer.device_probe import detect
    from trainer.flops import peak_flops
    from trainer.models import DEFAULT_VOCAB, hf_config, pad_vocab, training_flops_per_token, _model_class

    cfg = hf_config(spec.model, spec.size, vocab_size=pad_vocab(DEFAULT_VOCAB), seq_len=spec.seq_len)
    with torch.device("meta"):
        model = _model_class(spec.model)(cfg)
    fpt = training_flops_per_token(model, cfg, spec.seq_len)
    dev = detect(spec.device)
    peaks = {}
    from trainer.contract.capabilities import auto_precision

    for name in CONTENDERS:
        prec = "bf16" if name == "hf-fast" and hf_speed_args(dev).get("bf16") else "fp32"
        if name == "gptop":
            prec = auto_precision(dev)  # its default, --precision auto
        peaks[name] = (prec, None)
    cache: dict[str, float | None] = {}
    out = {}
    for name, (prec, _) in peaks.items():
        if name == "gptop-tuned":
            continue
        if prec not in cache:
            try:
                cache[prec] = peak_flops(dev, prec)
            except Exception:
                cache[prec] = None
        out[name] = cache[prec]
    return fpt, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Spec()
    ap.add_argument(
        "--model",
        default=d.model,
        choices=("llama",),
        help="model family (llama: the HF Trainer contender needs a plain causal LM)",
    )
    ap.add_argument("--size", default=d.size, choices=("tiny", "small", "medium", "large"))
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--global-batch", type=int, default=d.global_batch)
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="micro-batch of plain and HF (default: the global batch, no accumulation)",
    )
    ap.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="first steps excluded (multiple of --log-every)")
    ap.add_argument("--log-every", type=int, default=d.log_every, help="steps per measured interval")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in every contender (default: 1; 0: all cores). On a shared machine two "
        "OpenMP threads stall at every barrier whenever another process holds a core",
    )
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset, in run order")
    ap.add_argument("--tuned", metavar="TOML", default=None, help="best.toml of a gptop tune for gptop-tuned")
    ap.add_argument(
        "--tune",
        metavar="DURATION",
        default=None,
        help="run `gptop tune --tune-only --budget DURATION` first and use its best.toml",
    )
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    ap.add_argument("--keep", metavar="DIR", default=None, help="keep run logs and directories here")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before a contender's run is killed")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker:
        worker_main(a.worker, Spec(**json.loads(a.spec)), Path(a.out))
        return 0

    spec = Spec(
        model=a.model,
        size=a.size,
        seq_len=a.seq_len,
        global_batch=a.global_batch,
        micro_batch=a.micro_batch or a.global_batch,
        steps=a.steps,
        warmup=a.warmup,
        log_every=a.log_every,
        lr=a.lr,
        device=a.device,
        threads=a.threads or len(os.sched_getaffinity(0)),
    )
    if spec.global_batch % spec.micro_batch:
        ap.error("--micro-batch must divide --global-batch")
    if spec.warmup % spec.log_every or spec.steps < spec.warmup + spec.log_every:
        ap.error("--warmup must be a multiple of --log-every and --steps >= --warmup + --log-every")
    contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        ap.error(f"unknown contender(s) {bad}; choose from {', '.join(CONTENDERS)}")

    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="gptop-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    command = "python bench/peers.py " + " ".join(sys.argv[1:])
    print(f"command: {command}".rstrip(), flush=True)
    print(f"machine: {machine_line(spec)}", flush=True)

    tuned: Path | None = None
    if "gptop-tuned" in contenders:
        if a.tuned:
            tuned = Path(a.tuned)
        elif a.tune:
            tuned = run_tune(spec, a.tune, work)
        elif default_tuned_path(spec).is_file():
            tuned = default_tuned_path(spec)
        if tuned is None:
            print("gptop-tuned: no best.toml (give --tuned PATH or --tune 3m); skipped", flush=True)
            contenders.remove("gptop-tuned")
        else:
            toggles = _toml_toggles(tuned)
            print(f"gptop-tuned: toggles from {tuned}: {toggles}", flush=True)

    sys.path.insert(0, str(ROOT))
    from trainer.optim import BETAS, EPS

    print(
        f"setup: {spec.model}/{spec.size}, seq-len {spec.seq_len}, global batch {spec.global_batch} "
        f"({spec.tokens_per_step} tokens/step), {spec.steps} steps (first {spec.warmup} excluded, intervals of "
        f"{spec.log_every}), constant lr {spec.lr}, AdamW betas {BETAS} eps {EPS} wd {spec.weight_decay}, "
        f"clip {spec.grad_clip}, seed {spec.seed}; {a.rounds} rounds x {len(contenders)} contenders, alternating",
        flush=True,
    )
    results: list[RunResult] = []
    for rnd in range(a.rounds):
        for name in contenders:
            r = run_contender(name, rnd, spec, tuned, work, a.timeout)
            results.append(r)
            meds = [i["tokens_per_s"] for i in r.intervals if i["tokens_per_s"]]
            status = r.error or (f"{statistics.median(meds):,.0f} tok/s" if meds else "no steady interval")
            print(f"round {rnd + 1} {name:12s} {status}  (process {r.wall_s or 0:.0f} s)", flush=True)

    show_mfu = spec.device.startswith("cuda")
    fpt, peaks = model_flops(spec) if show_mfu else (None, {})
    if tuned is not None and show_mfu:
        prec = _toml_toggles(tuned).get("precision", "fp32")
        try:
            sys.path.insert(0, str(ROOT))
            from trainer.device_probe import detect
            from trainer.flops import peak_flops

            peaks["gptop-tuned"] = peak_flops(detect(spec.device), prec)
        except Exception:
            peaks["gptop-tuned"] = None
    rows = summarize(results, spec, fpt, peaks)
    print()
    print(table(rows, show_mfu))
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s; logs in {work}")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "machine": machine_line(spec),
                    "spec": asdict(spec),
                    "tuned": str(tuned) if tuned else None,
                    "rows": rows,
                    "runs": [asdict(r) for r in results],
                },
                indent=1,
            )
        )
    return 0


def _toml_toggles(path: Path) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(Path(path).read_text()).get("toggles", {})


if __name__ == "__main__":
    sys.exit(main())
