"""bf16 against fp32 matmuls on this CPU, natively and with oneDNN held to AVX2 (a CPU without AVX-512 bf16).

    python bench/bf16_matmul.py                 # one thread, 512x512, 2 s of CPU time per figure
    python bench/bf16_matmul.py --n 1024 --seconds 3

Each figure is GFLOP/s of CPU time (`time.process_time`: on a shared machine the wall clock is noise) for
`a @ b` on one thread. The AVX2 figures come from a child process with ONEDNN_MAX_CPU_ISA=AVX2, oneDNN's own
switch for the instruction set it may use: on a CPU with AVX-512 bf16 it shows what a CPU without it gets
(bf16 emulated), which is why gptop calls bf16 slow there (trainer/contract/capabilities.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(n: int, seconds: float) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        a @ b  # warm-up: oneDNN picks and JITs its kernel
        reps, t0 = 0, time.process_time()
        while time.process_time() - t0 < seconds:
            a @ b
            reps += 1
        out[name] = 2 * n**3 * reps / (time.process_time() - t0) / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=512, help="matrix size (default: 512)")
    ap.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per figure (default: 2)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.n, args.seconds)))
        return 0
    rows = {}
    for label, extra in (("native", {}), ("oneDNN held to AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2"})):
        r = subprocess.run(
            [sys.executable, __file__, "--child", "--n", str(args.n), "--seconds", str(args.seconds)],
            env={**os.environ, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        rows[label] = json.loads(r.stdout)
    from trainer.contract.device import cpu_name

    cpu = cpu_name()
    print(f"{args.n}x{args.n} matmul, 1 thread, {cpu}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for label, r in rows.items():
        print(
            f"  {label:20s} fp32 {r['fp32']:6.1f} GFLOP/s  bf16 {r['bf16']:6.1f} GFLOP/s  "
            f"bf16/fp32 {r['bf16'] / r['fp32']:.3g}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
