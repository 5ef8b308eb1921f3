"""What reading an event costs gptop: parse (validate) a JSON line, fold it into the RunState, write it back.

The dashboard's process parses every line the trainer sends (a step event per log interval, per rank)
and every device sample (2 per second), applies it to the RunState and, with --json or device.jsonl,
writes it back out. This times those three on real lines (a step event of a MoE model with expert
loads, a GPU device sample, a hello), as a ratio against `json.loads` of the same line measured in
the same run, and in microseconds.

    python bench/events.py [--n 20000] [--json]

The script uses only the public `parse`, `dumps` and `RunState.apply`, so it runs against any version
of the tree: `PYTHONPATH=OTHER_TREE python bench/events.py` for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

LINES = {
    "step": '{"v":1,"type":"step","time":1795456093.5,"rank":0,"step":120,"tokens":491520,"loss":3.2512,'
    '"lr":0.00098,"grad_norm":0.812,"step_ms":251.3,"phases_ms":{"data":2.1,"forward":80.2,'
    '"backward":140.9,"optimizer":20.3,"other":7.8},"tokens_per_s":16301.2,"mfu":0.312,'
    '"mem_bytes":21474836480,"interval_steps":10,"wall_ms":252.0,"batch":119,"gpu_idle_ms":12.5,'
    '"expert_load":[[0.12,0.13,0.12,0.13,0.12,0.13,0.12,0.13],[0.1,0.15,0.1,0.15,0.1,0.15,0.1,0.15],'
    "[0.12,0.13,0.12,0.13,0.12,0.13,0.12,0.13],[0.1,0.15,0.1,0.15,0.1,0.15,0.1,0.15]]}",
    "device": '{"v":1,"type":"device","time":1795456094.0,"rank":0,"mode":"gpu","devices":[{"index":0,'
    '"name":"NVIDIA H100 80GB HBM3","util_pct":97.0,"mem_used":51539607552,"mem_total":85899345920,'
    '"power_w":612.3,"power_limit_w":700.0,"energy_j":123456.789,"temp_c":67.0,"sm_clock_mhz":1980.0,'
    '"proc_mem":49392123904}],"cpu":{"util_pct":12.5,"per_core":[30.0,5.0,80.0,2.0,30.0,5.0,80.0,'
    '2.0,30.0,5.0,80.0,2.0,30.0,5.0,80.0,2.0],"mem_used":42949672960,"mem_total":2147483648000,'
    '"proc_rss":6442450944,"proc_cpu_pct":6.3,"power_w":null,"energy_j":null,'
    '"name":"Intel Xeon Platinum 8480+"}}',
    "hello": '{"v":1,"type":"hello","time":1795456092.9,"rank":0,"pid":15177,"world_size":1,"parallel":null,'
    '"config":{"model":{"model":"deepseek","size":"tiny"},"data":{"data":"builtin","tokenizer":null,'
    '"seq_len":32,"val_fraction":0.01},"optim":{"global_batch":4,"max_steps":4,"lr":0.001,'
    '"warmup_steps":2,"min_lr_ratio":0.1,"weight_decay":0.1,"grad_clip":1.0,"seed":1234},'
    '"toggles":{"precision":"fp32","compile":"off","micro_batch":"2","prefetch":2,"workers":0,'
    '"fused_adamw":true,"activation_checkpointing":false,"attention":"sdpa","cuda_allocator":"default"}},'
    '"device":{"type":"cpu","index":null,"name":"cpu","capability":null,"total_memory":25000000000,'
    '"cpu_count":2,"has_compiler":true,"cpu_bf16":false},"model":{"family":"deepseek","size":"tiny",'
    '"total_params":3800000,"active_params":3000000,"embedding_params":1000000,"vocab_size":8192,'
    '"flops_per_token":18000000,"objective":"causal"},"data":{"train_tokens":100000,'
    '"val_tokens":1000,"fingerprint":"ab"},"accumulation":2,"micro_batch":2,"tokens_per_step":128,'
    '"peak_flops":30000000000.0,"resumed_from":null,"start_step":0,"torch":"2.13.0"}',
}


def per_call_us(fn: Callable[[], Any], n: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `n` calls, in microseconds."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timing (default: 20000)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    from gptop.state import RunState
    from trainer.contract.events import dumps, parse

    state = RunState()
    state.apply(parse(LINES["hello"]))
    result: dict[str, Any] = {}
    for kind, line in LINES.items():
        event = parse(line)
        base = per_call_us(lambda: json.loads(line), args.n)
        p = per_call_us(lambda: parse(line), args.n)
        d = per_call_us(lambda: dumps(event), args.n)
        a = per_call_us(lambda: state.apply(event), args.n // 4 if kind == "hello" else args.n)
        result[kind] = {
            "json_loads_us": round(base, 2),
            "parse_us": round(p, 2),
            "dumps_us": round(d, 2),
            "apply_us": round(a, 2),
            "parse_x_json_loads": round(p / base, 2),
            "read_x_json_loads": round((p + a) / base, 2),
        }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{'event':8} {'json.loads':>11} {'parse':>9} {'apply':>9} {'dumps':>9}   parse/json.loads  "
        "(parse+apply)/json.loads"
    )
    for kind, r in result.items():
        print(
            f"{kind:8} {r['json_loads_us']:9.1f}us {r['parse_us']:7.1f}us {r['apply_us']:7.1f}us "
            f"{r['dumps_us']:7.1f}us   {r['parse_x_json_loads']:15.2f}x  {r['read_x_json_loads']:22.2f}x"
        )


if __name__ == "__main__":
    main()
