"""What issue 20's two watchers cost a training step, as ratios measured in the same run.

- The profile summary (trainer/profile_summary.py): a window of `--window` steps of a Llama (`--size`, medium by
  default) is captured with torch.profiler, as the trainer does (a `ProfilerStep#N` range per step, the phase
  ranges of the step timer), then summarized from `prof.events()`. Reported: the summary's time over the
  window's own training time, and the peak memory it allocates (tracemalloc, Python allocations) over the
  process's resident set.
- The compile watchdog (trainer/compile_watch.py): `CompileWatch.poll()` is what the trainer adds to every
  step of a compiled run (dynamo's counters and its log handler, read without a synchronization). Reported:
  its time per call over a step's time, rounds of steps with and without the poll alternating.

    OMP_NUM_THREADS=2 python bench/profile_cost.py [--size medium] [--window 3] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.compile_watch import CompileWatch  # noqa: E402
from trainer.contract.config import TrainConfig  # noqa: E402
from trainer.device_probe import detect  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.profile_summary import spans_from_profiler, summarize  # noqa: E402
from trainer.profiler import STEP_RANGE  # noqa: E402


def make_step(size: str, seq_len: int, batch: int):
    cfg = TrainConfig()
    cfg.model.model, cfg.model.size = "llama", size
    dev = detect("cpu")
    bundle = build_model(cfg.model, vocab_size=32000, seq_len=seq_len, toggles=cfg.toggles, dev=dev)
    model = bundle.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = bundle.vocab_size if hasattr(bundle, "vocab_size") else 32000
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, min(vocab, 32000), (batch, seq_len), generator=g)
    params = sum(p.numel() for p in model.parameters())

    def step(annotate: bool) -> None:
        rf = torch.profiler.record_function if annotate else None

        def phase(name):
            return rf(name) if rf else _null()

        with phase("data"):
            inp, tgt = x[:, :-1], x[:, 1:]
        with phase("forward"):
            out = model(inp)
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step, params


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    step, params = make_step(a.size, a.seq_len, a.batch)
    step(False)  # warm-up: allocator, first-touch

    # --- the summary of one window
    def window() -> tuple[torch.profiler.profile, float]:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        t0 = time.perf_counter()
        prof.start()
        for i in range(a.window):
            with torch.profiler.record_function(STEP_RANGE.format(i + 1)):
                step(True)
        prof.stop()
        return prof, time.perf_counter() - t0

    # time and memory from two windows: tracemalloc slows every Python allocation several times, so the
    # timed pass runs without it
    prof, window_s = window()
    t0 = time.perf_counter()
    events = prof.events()  # torch.profiler builds its FunctionEvents (lazily, on first use)
    events_s = time.perf_counter() - t0
    summary = summarize(spans_from_profiler(events))
    summary_s = time.perf_counter() - t0
    n_events = len(events)
    prof, _ = window()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    summarize(spans_from_profiler(prof.events()))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # --- the watchdog's poll, alternating rounds of steps with and without it
    watch = CompileWatch()
    plain, polled = [], []
    for _ in range(a.rounds):
        for polls, out in ((False, plain), (True, polled)):
            t0 = time.perf_counter()
            step(False)
            if polls:
                watch.poll()
            out.append(time.perf_counter() - t0)
    watch.close()
    poll_calls = 20000
    t0 = time.perf_counter()
    for _ in range(poll_calls):
        watch.poll()
    poll_s = (time.perf_counter() - t0) / poll_calls
    step_s = statistics.median(plain)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "torch": torch.__version__,
        "model": f"llama {a.size}",
        "params": params,
        "seq_len": a.seq_len,
        "batch": a.batch,
        "window_steps": a.window,
        "window_s": window_s,
        "profiler_events": n_events,
        "summary_s": summary_s,
        "summary_over_window": summary_s / window_s,
        "events_s": events_s,
        "own_s": summary_s - events_s,
        "own_over_window": (summary_s - events_s) / window_s,
        "summary_peak_bytes": peak,
        "summary_peak_over_rss": peak / rss0 if rss0 else None,
        "summary_ok": summary is not None,
        "step_s": step_s,
        "step_with_poll_s": statistics.median(polled),
        "poll_s": poll_s,
        "poll_over_step": poll_s / step_s,
    }
    print(
        f"llama {a.size} ({params / 1e6:.0f}M params), {a.batch}x{a.seq_len} tokens, on {result['cpus']} CPUs, "
        f"load {result['load'][0]:.2f}"
    )
    print(
        f"summary of a {a.window}-step window ({n_events} profiler events): {summary_s * 1e3:.0f} ms, "
        f"{result['summary_over_window']:.2%} of the window's {window_s:.1f} s (prof.events() {events_s * 1e3:.0f} ms, "
        f"the summary's own arithmetic {(summary_s - events_s) * 1e3:.0f} ms, "
        f"{result['own_over_window']:.2%}); peak {peak / 2**20:.1f} MiB "
        f"allocated ({result['summary_peak_over_rss']:.2%} of the process's resident peak)"
    )
    print(
        f"watchdog poll: {poll_s * 1e6:.1f} us a step, {result['poll_over_step']:.5%} of a {step_s:.2f} s step "
        f"(steps with it {result['step_with_poll_s']:.2f} s, without {step_s:.2f} s, medians of {a.rounds})"
    )
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
