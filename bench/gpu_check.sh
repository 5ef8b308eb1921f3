#!/usr/bin/env bash
# One prepared check of gptop on a GPU machine (issue 27): `gptop doctor --device cuda --json`, then short
# end-to-end trainer runs of the paths the doctor's bug list was about, each with its own timeout. It keeps
# going when a step fails and ends with a compact table; everything it saw goes under $OUT (default
# ./doctor-out): doctor-quick.json (`--quick`, first), doctor.json (every path, last, with the time left),
# doctor-checks.log (the checks' own output), summary.txt, runs.tar.gz (each run's events.jsonl, logs and
# config, no checkpoints).
#
#   bash bench/gpu_check.sh                  # on the GPU machine (about 4-6 minutes on an H100)
#   bash bench/gpu_check.sh --device cpu     # the same steps on the CPU, with the CPU's expectations
#
# Needs the project's Python dependencies; the trainer writes config.toml with tomli-w (checked first).
# Environment: PYTHON (default python3), OUT, BUDGET_S (default 300: runs not started by then are skipped;
# the whole doctor gets what is left of BUDGET_S + 60 s, at least 120 s), DOCTOR (default 1; 0 runs the
# end-to-end runs alone, for a caller that runs the doctor by itself so its timings see an idle GPU).
set -u

DEVICE=cuda
if [ "${1:-}" = "--device" ] && [ -n "${2:-}" ]; then DEVICE=$2; fi
case "$DEVICE" in cpu|cuda|cuda:[0-9]*) ;; *) echo "gpu_check.sh: --device: '$DEVICE' is not cpu, cuda or cuda:N" >&2; exit 2;; esac
KIND=${DEVICE%%:*}
PY=${PYTHON:-python3}
OUT=${OUT:-./doctor-out}
BUDGET_S=${BUDGET_S:-300}
DOCTOR=${DOCTOR:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gptop-gpu-check.XXXXXX")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GPTOP_CACHE="$WORK/cache" GPTOP_BUILTIN_BYTES=300000 TOKENIZERS_PARALLELISM=false   # a small corpus: seconds to tokenize
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
ROWS=()

row() {   # name, expected, got, verdict, detail
    ROWS+=("$(printf '%-26s %-9s %-6s %-8s %s' "$1" "$2" "$3" "$4" "$5")")
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$SUMMARY"
    echo "== $1: $4 (expected $2, got $3) $5"
}

late() { [ $(( $(date +%s) - START )) -ge "$BUDGET_S" ]; }

echo "== gpu_check: device $DEVICE, python $($PY -c 'import sys; print(sys.version.split()[0])'), out $OUT, work $WORK"
$PY - <<'EOF'
import importlib.util
for m in ("torch", "transformers", "peft", "torchao", "tomli_w", "optuna", "textual", "bitsandbytes", "pynvml"):
    print(f"   {m}: {'yes' if importlib.util.find_spec(m) else 'MISSING'}")
EOF
if ! $PY -c "import tomli_w" 2>/dev/null; then
    echo "== WARNING: tomli_w is missing: the trainer cannot write config.toml, so the end-to-end runs will fail"
fi

# --- the doctor ------------------------------------------------------------------------------------------------
doctor() {   # name, extra flags, timeout: gptop doctor --json into $OUT/<name>.json, one row
  local name=$1 flags=$2 limit=$3 t0 code log detail v
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" $PY -m gptop doctor --device "$DEVICE" --json $flags > "$OUT/$name.json" 2> "$WORK/$name.stderr"
  code=$?
  log=$(ls -t "${TMPDIR:-/tmp}"/gptop-doctor-*.log 2>/dev/null | head -1)
  { echo "=== $name"; cat "$WORK/$name.stderr"; if [ -n "$log" ] && [ "$log" -nt "$OUT/summary.txt" ]; then echo "--- $log"; cat "$log"; fi; } >> "$OUT/doctor-checks.log" 2>/dev/null
  detail=$($PY - "$OUT/$name.json" <<'PYEOF' 2>&1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"no record ({type(e).__name__})"); sys.exit()
c = r["counts"]
bad = [f"{x['name']}: {(x['reason'] or '')[:100]}" for x in r["checks"] if x["status"] == "fail"]
ran = ", ".join(x["name"] for x in r["checks"] if x["status"] == "pass")
print(f"{c['pass']} pass {c['fail']} fail {c['skip']} skip" + (f"; FAILED {'; '.join(bad)}" if bad else "")
      + f"; passed: {ran}")
PYEOF
)
  if [ $code -eq 0 ]; then v=ok; else v=MISMATCH; fi
  [ $code -eq 124 ] && detail="timed out after ${limit}s; $detail"
  row "$name" 0 "$code" "$v" "$(( $(date +%s) - t0 ))s: $detail"
}

: > "$OUT/doctor-checks.log"
[ "$DOCTOR" = 1 ] && doctor doctor-quick --quick 150          # everything but torch.compile, NCCL and QLoRA: fast, first

# --- end-to-end trainer runs -------------------------------------------------------------------------------
# name, expected exit code on cuda, on cpu, timeout s, trainer arguments
TINY="--model llama --size tiny --seq-len 128 --global-batch 8 --log-every 5 --eval-every 0 --warmup-steps 2"
MB=(4 8)                     # a micro-batch with accumulation 2, and the whole batch
if [ "$KIND" = cpu ]; then   # a quarter of the work: the CPU form checks the logic, not the speed
  TINY="--model llama --size tiny --seq-len 64 --global-batch 4 --log-every 5 --eval-every 0 --warmup-steps 2"
  MB=(2 4)
fi
STEPS=(
  "train20|0|0|120|$TINY --max-steps 20 --checkpoint-every 10 --run-dir $WORK/resume"
  "resume30|0|0|90|--resume $WORK/resume --max-steps 30"
  "bf16|0|0|90|$TINY --max-steps 10 --precision bf16 --run-dir $WORK/bf16"
  "fp16|0|2|90|$TINY --max-steps 10 --precision fp16 --run-dir $WORK/fp16"
  "prefetch2|0|0|90|$TINY --max-steps 10 --prefetch 2 --workers 1 --run-dir $WORK/prefetch"
  "cudagraph-accum2-refused|2|2|90|$TINY --max-steps 10 --compile reduce-overhead --micro-batch ${MB[0]} --run-dir $WORK/cg-accum"
  "cudagraph-no-accum|0|2|200|$TINY --max-steps 10 --compile reduce-overhead --micro-batch ${MB[1]} --run-dir $WORK/cg"
  "microbatch-auto-small|0|0|150|--model llama --size small --seq-len 256 --global-batch 64 --micro-batch auto --max-steps 3 --log-every 1 --eval-every 0 --run-dir $WORK/auto"
)
if [ "$KIND" = cpu ]; then   # the CPU form of the last one: tiny, since a small llama step takes minutes there
  STEPS[7]="microbatch-auto-tiny|0|0|150|$TINY --micro-batch auto --max-steps 3 --log-every 1 --run-dir $WORK/auto"
fi

for spec in "${STEPS[@]}"; do
  IFS='|' read -r name want_cuda want_cpu limit args <<< "$spec"
  if [ "$KIND" = cpu ]; then want=$want_cpu; else want=$want_cuda; fi
  if late; then row "$name" "$want" "-" skipped "out of time (BUDGET_S=$BUDGET_S)"; continue; fi
  run_dir=$(echo "$args" | sed -n 's/.*--run-dir \([^ ]*\).*/\1/p')
  [ -z "$run_dir" ] && run_dir=$(echo "$args" | sed -n 's/.*--resume \([^ ]*\).*/\1/p')
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" $PY -m trainer $args --device "$DEVICE" > "$WORK/$name.out" 2> "$WORK/$name.err"
  code=$?
  secs=$(( $(date +%s) - t0 ))
  detail=$($PY - "$run_dir" "$name" <<'EOF' 2>&1
import json, sys
from pathlib import Path
run_dir, name = Path(sys.argv[1]), sys.argv[2]
events = []
path = run_dir / "events.jsonl"
if path.is_file():
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
hello = [e for e in events if e.get("type") == "hello" and not e.get("early")]
steps = [e for e in events if e.get("type") == "step"]
errors = [e for e in events if e.get("type") == "error"]
skipped = [e for e in events if e.get("type") == "warning" and "checkpoint skipped" in e.get("message", "")]
out = []
if hello:
    h = hello[-1]
    out.append(f"start {h.get('start_step')} mb {h.get('micro_batch')}x{h.get('accumulation')} "
               f"{(h.get('config') or {}).get('toggles', {}).get('precision')}")
if steps:
    s = steps[-1]
    tps = s.get("tokens_per_s")
    ph = s.get("phases_ms") or {}
    out.append(f"step {s.get('step')} loss {s.get('loss'):.3f} {tps:,.0f} tok/s" if tps else f"step {s.get('step')}")
    if ph:
        out.append("phases " + "/".join(f"{ph.get(k, 0):.1f}" for k in ("data", "forward", "backward", "optimizer", "other")) + " ms")
if errors:
    e = errors[-1]
    out.append(f"error {e.get('kind')}: {e.get('message', '')[:140]}")
if skipped:
    out.append(f"{len(skipped)} checkpoint(s) skipped as corrupt")
if name == "resume30" and hello and hello[-1].get("start_step") != 20:
    out.append("RESUME DID NOT START AT 20")
print("; ".join(out) or f"no events in {path}")
EOF
)
  if [ "$code" = "$want" ]; then v=ok; else v=MISMATCH; fi
  if [ "$name" = resume30 ] && echo "$detail" | grep -q "RESUME DID NOT\|skipped as corrupt"; then v=MISMATCH; fi
  [ $code -eq 124 ] && detail="timed out after ${limit}s; $detail"
  [ "$v" = MISMATCH ] && detail="$detail; stderr: $(tail -c 300 "$WORK/$name.err" | tr '\n' ' ')"
  row "$name" "$want" "$code" "$v" "${secs}s: $detail"
done

# --- the whole doctor (the record for docs/doctor/), with the time that is left ---------------------------------
left=$(( BUDGET_S + 60 - ($(date +%s) - START) ))
[ "$left" -lt 120 ] && left=120
[ "$DOCTOR" = 1 ] && doctor doctor "" "$left"

# --- what comes back ---------------------------------------------------------------------------------------
(cd "$WORK" && tar czf "$OUT/runs.tar.gz" --exclude='checkpoints' --exclude='cache' --exclude='*.pt' . 2>/dev/null)
echo
echo "gpu_check on $DEVICE ($(( $(date +%s) - START )) s; the record: $OUT/doctor.json)"
printf '%-26s %-9s %-6s %-8s %s\n' step expected exit verdict detail
for r in "${ROWS[@]}"; do echo "$r"; done
rm -rf "$WORK"
if grep -q $'\tMISMATCH\t' "$SUMMARY"; then exit 1; fi
exit 0
