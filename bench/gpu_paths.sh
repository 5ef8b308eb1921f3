#!/usr/bin/env bash
# CUDA paths beyond bench/gpu_check.sh, as gptop's commands (not the trainer alone) run them, three groups at once
# (so speeds here are not figures): `gptop tune -- CMD` over a transformers.Trainer script, stopped by SIGTERM
# once the tuner decided; the low-bit optimizers (train, resume, switched live by the tuner); NVML under a UUID
# CUDA_VISIBLE_DEVICES; a whole QLoRA run (nf4, its resume and the refused export, int8) from an exported model
# directory; Lightning with gptop's callback. Exit codes and each run's events come back under $OUT.
#
#   OUT=/tmp/paths bash bench/gpu_paths.sh    # on a GPU machine, about 6 minutes on an H100
#
# Wheels of packages the machine lacks may be put in ./.whl (docs/doctor/README.md says which).
set -u
T0=$(date +%s)
OUT=${OUT:-./gpu-paths-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # absolute: the end packs the runs from inside their directory
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2   # .whl/ and examples/ are the checkout's
SITE=
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 3; }
  SITE=:/tmp/site
fi
export PYTHONPATH="$ROOT:$ROOT/examples$SITE" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=$(mktemp -d /tmp/gs.XXXX)
export GPTOP_CACHE=$W/cache GPTOP_BUILTIN_BYTES=300000
L=$OUT/logs; mkdir -p "$L"
{ nvidia-smi -L; python3 -c 'import torch,sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'; python3 -m pip list 2>/dev/null | grep -iE "^(transformers|peft|accelerate|lightning|torchao|bitsandbytes|nvidia-ml-py) "; } > "$L/versions.txt" 2>&1
TINY="--model llama --size tiny --seq-len 128 --global-batch 8 --log-every 5 --eval-every 0 --warmup-steps 2 --device cuda"
G="python3 -m gptop --no-ui"
rc() { echo "$1 rc=$2 $(( $(date +%s) - $3 ))s at $(( $(date +%s) - T0 ))s" >> "$L/rc.txt"; }
step() { local name=$1 lim=$2; shift 2; local t=$(date +%s); timeout -k 10 "$lim" "$@" > "$L/$name.log" 2>&1; rc "$name" $? $t; }

# A. the tuner on a transformers.Trainer script (gptop tune -- CMD): a run long enough for a trial to pay for the
# script's restarts; SIGTERM after 250 s (a scheduler's limit) must stop it with a checkpoint, nothing left behind
(
  t=$(date +%s)
  timeout -s TERM -k 30 250 $G tune --budget 120s --run-dir $W/tunecmd -- python3 examples/train_transformers.py --steps 30000 --batch 2 --accumulation 4 --out $W/tc-ck > "$L/tunecmd.log" 2>&1
  rc tunecmd-sigterm $? $t
  echo "processes of the script left: $(pgrep -fc train_transformers)" >> "$L/rc.txt"
) &
# B. low-bit optimizers (train, resume, switched live by the tuner), NVML under a UUID
(
  for o in adamw-8bit adamw-4bit adafactor; do
    step opt-$o 120 $G train $TINY --optimizer $o --max-steps 20 --checkpoint-every 10 --run-dir $W/opt-$o
    step opt-$o-resume 90 $G train --resume $W/opt-$o --max-steps 30
  done
  step optswitch 200 $G tune --budget 100s --tune-only $TINY --tune-space "-all optimizer=adamw,adamw-8bit,adamw-4bit" --run-dir $W/optswitch
  UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
  CUDA_VISIBLE_DEVICES=$UUID step uuid 120 $G --json train $TINY --max-steps 40 --run-dir $W/uuid
) &
# C. a whole QLoRA run from a model directory (nf4 and int8, and a resume), then Lightning and the probe
(
  step base 120 $G train $TINY --max-steps 10 --run-dir $W/base
  step export 120 $G export $W/base $W/base-hf
  step qlora-nf4 150 $G train --model $W/base-hf --lora 8 --quantize-base nf4 --seq-len 128 --global-batch 8 --max-steps 20 --checkpoint-every 10 --log-every 5 --eval-every 0 --device cuda --run-dir $W/q4
  step qlora-nf4-resume 120 $G train --resume $W/q4 --max-steps 30
  step qlora-nf4-export 120 $G export $W/q4 $W/q4-hf
  step qlora-int8 150 $G train --model $W/base-hf --lora 8 --quantize-base int8 --seq-len 128 --global-batch 8 --max-steps 20 --log-every 5 --eval-every 0 --device cuda --run-dir $W/q8
  step lightning 150 $G run --run-dir $W/lightning -- python3 examples/train_lightning.py --steps 60 --out $W/l-ck
) &
wait
echo "all done at $(( $(date +%s) - T0 ))s" >> "$L/rc.txt"
# what each run's events say: hello, last step, errors, warnings
python3 - "$W" > "$L/events-summary.txt" 2>&1 <<'PY'
import json, sys
from pathlib import Path
for ev in sorted(Path(sys.argv[1]).glob("*/events.jsonl")):
    rows = []
    for line in ev.read_text().splitlines():
        try: rows.append(json.loads(line))
        except ValueError: pass
    print(f"== {ev.parent.name}: {len(rows)} events")
    for e in rows:
        t = e.get("type")
        if t == "hello" and not e.get("early"):
            c = e.get("config") or {}
            print("  hello", {k: e.get(k) for k in ("client", "start_step", "micro_batch", "accumulation", "world_size", "tunable")}, (c.get("toggles") or {}))
        elif t in ("error", "warning", "alert", "done", "apply"):
            print(" ", t, {k: v for k, v in e.items() if k not in ("v", "t", "type")}.__repr__()[:400])
        elif t == "tuner" and e.get("phase") in ("done",):
            print("  tuner", e.get("phase"), (e.get("message") or "")[:300])
        elif t == "trial" and e.get("status") != "running":
            print("  trial", {k: e.get(k) for k in ("n", "kind", "status", "outcome", "tokens_per_s", "toggles")}.__repr__()[:300])
    steps = [e for e in rows if e.get("type") == "step"]
    if steps:
        s = steps[-1]
        print("  last step", s.get("step"), "rank", s.get("rank"), "loss", s.get("loss"), "tok/s", s.get("tokens_per_s"), "phases", s.get("phases_ms"), "mem", s.get("peak_mem_bytes") or s.get("memory"))
    dev = [e for e in rows if e.get("type") == "device"]
    if dev:
        print("  device", json.dumps(dev[-1])[:600])
PY
cat "$L/rc.txt"; cat "$L/events-summary.txt" | cut -c1-600 | head -150
(cd $W && tar czf "$OUT/runs.tar.gz" --exclude='cache' --exclude='*.pt' --exclude='*.safetensors' --exclude='*.distcp' --exclude='*-ck' . 2>/dev/null)
(cd "$OUT" && tar czf logs.tar.gz logs && cp logs/rc.txt logs/versions.txt logs/events-summary.txt . && rm -rf logs)
ls -la "$OUT"
