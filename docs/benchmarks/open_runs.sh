#!/usr/bin/env bash
# The GPU runs of issues 33 and 37 as device calls (made on 2026-11-28 with the three commands
# below; records in docs/bench_sagebwd_h200.json, docs/bench_14b_h200.json and
# docs/repro/dev-lora-sagebwd/). LANES lists what each GPU does, one lane per GPU (space-separated),
# the jobs of a lane one after the other (joined by '+'); all within DEADLINE seconds. Device time
# is counted per machine held, not per GPU, so a lane on every GPU costs what one does. Jobs:
#
#   sagebwd  tests/test_sagebwd_gpu.py, then kernels/sagebwd_bench.py --variants --pick --profile
#            (the split's launches apart, dQ from stored dS, their best combinations; docs/benchmarks.md,
#            "The backward's structure") -> $W/sagebwd_bench.json, copied to $OUT with sagebwd.log
#   floors   docs/benchmarks/sagebwd_floors.py: bench kernels / wan / train, cuDNN or BF16 beside
#            sagebwd with the picked tiles (reads $W/sagebwd_bench.json, else $BENCH_JSON)
#            -> $OUT/floors/*.json, $OUT/floors.log
#   train    attnqat repro's training of the LoRA study's runs (qad, qad-lora8/32/128) and the
#            SageBwd fine-tuning rows' (sagebwd, bf16, attnqat): one process a run, all at once
#   eval     their evaluation, development prompts 220-459 only (docs/finetune.md, LoRA; issue 33):
#            the base's configurations first, then the others in parallel processes; the report
#            once every configuration is recorded -> $OUT/study.tar.gz (records, logs; no weights)
#   14b:ROWS docs/benchmarks/14b_one_gpu.sh with those rows (comma-separated; "14b" alone: ROWS14,
#            default lora32) -> $OUT/14b-ROWS/
#
# Work folders stay on a warm machine (30 s idle), so a second call continues: repro skips runs
# trained and configurations recorded (one cut off is evaluated again from its start).
#
#   LANES="sagebwd+14b train+eval" OUT=/tmp/out bash docs/benchmarks/open_runs.sh   # 2 GPUs, call 1
#   LANES="floors+14b train+eval" ROWS14=full-offload-8bit OUT=... bash ...          # call 2
#   LANES="14b:full-offload-8bit 14b:full-8bit" ROW_LIMIT_S=600 OUT=... bash ...       # call 3
#
# The call begins with the wheel install of docs/development.md ("Running on the lent GPU").
# Environment: OUT (required), LANES (default "sagebwd+floors train+eval+14b"), DEADLINE (seconds,
# default 540), WORK (default /tmp/open_runs). On one GPU the lanes run one after the other.
set -u
cd "$(dirname "$0")/../.." || exit 2   # the repository root
OUT=${OUT:?set OUT to the folder for the results}
LANES=${LANES:-sagebwd+floors train+eval+14b}
DEADLINE=${DEADLINE:-540}
W=${WORK:-/tmp/open_runs}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$W"
T0=$(date +%s)
el() { echo "[open_runs $(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
read -r -a lanes <<< "$LANES"
el "$ngpu GPU(s); lanes: ${lanes[*]}; deadline $DEADLINE s"

study() {   # study ARGS...: attnqat repro with the study's settings (development prompts only)
  attnqat repro --work "$W/study" --runs qad,qad-lora8,qad-lora32,qad-lora128,sagebwd,bf16,attnqat \
    --steps 200 --lr 2e-5 --warmup 20 --ema 0.98 --batch-size 32 --device cuda --no-progress \
    --eval-offset 220 --eval-prompts 240 --eval-batch 240 --eval-backend auto "$@"
}
# the evaluation's processes: the base's first (every record's BF16 reference), then these at once
EVAL_GROUPS="qad-nvfp4,qad-lora8-nvfp4 qad-lora32-nvfp4,qad-lora128-nvfp4 base-sagebwd,sbwd-sagebwd
             sbwd-nvfp4,sbwd-bf16 qat-nvfp4,control-nvfp4,control-bf16"

pack() {   # the study's records, logs and report, without weights or caches
  tar czf "$OUT/study.tar.gz" -C "$W" --exclude='checkpoints' --exclude='cache' \
    --exclude='*.safetensors' --exclude='tb' study
}

job() {
  case $1 in
    sagebwd)
      { python3 -P -m pytest -q -m gpu tests/test_sagebwd_gpu.py
        python3 -P -m attnqat.kernels.sagebwd_bench --variants --pick --profile --rep-ms 250 \
          --json "$W/sagebwd_bench.json"; } > "$OUT/sagebwd.log" 2>&1
      cp "$W/sagebwd_bench.json" "$OUT/" 2>/dev/null ;;
    floors)
      local bench="$W/sagebwd_bench.json"
      [ -f "$bench" ] || bench=${BENCH_JSON:-$bench}
      python3 -P docs/benchmarks/sagebwd_floors.py "$bench" "$OUT/floors" > "$OUT/floors.log" 2>&1 ;;
    train)
      local pids=() r tl=$(( ($(left) - 180) / 60 ))   # minutes, leaving 3 for the evaluation
      [ "$tl" -lt 1 ] && tl=1
      mkdir -p "$W/study/logs"
      for r in qad qad-lora8 qad-lora32 qad-lora128 sagebwd bf16 attnqat; do
        study --runs "$r" --stages train --workers 3 \
          --time-limit "$tl" >> "$W/study/logs/train-$r.log" 2>&1 &
        pids+=($!)
      done
      wait "${pids[@]}" ;;
    eval)
      local g pids=()
      mkdir -p "$W/study/logs"
      study --stages eval --configs base-bf16,base-nvfp4 --workers 3 \
        >> "$W/study/logs/eval-base.log" 2>&1 &
      pids+=($!)
      while ! ls "$W"/study/cache/base-bf16-*.npy > /dev/null 2>&1; do   # its BF16 clips first
        kill -0 "${pids[0]}" 2>/dev/null || { el "the base's evaluation ended early"; break; }
        sleep 2
      done
      for g in $EVAL_GROUPS; do
        study --stages eval --configs "$g" --workers 3 \
          >> "$W/study/logs/eval-${g%%,*}.log" 2>&1 &
        pids+=($!)
      done
      wait "${pids[@]}"
      study --stages report >> "$W/study/logs/report.log" 2>&1 ;;
    14b|14b:*)
      local rows=${1#14b:}
      [ "$rows" = "$1" ] && rows=${ROWS14:-lora32}
      OUT="$OUT/14b-$rows" WORK="$W/14b-$rows" ROWS=$rows BUDGET_S=$(( $(left) - 20 )) \
        bash docs/benchmarks/14b_one_gpu.sh > "$W/14b-$rows.log" 2>&1 ;;
    *) el "unknown job $1 (sagebwd, floors, train, eval, 14b)"; return 2 ;;
  esac
}
export -f el left study job
export OUT W DEADLINE T0 EVAL_GROUPS

run_lane() {   # run_lane INDEX: the lane's jobs in order on its GPU, all killed at the deadline
  local gpu=$(( ngpu > 1 ? $1 % ngpu : 0 )) j
  IFS=+ read -r -a js <<< "${lanes[$1]}"
  for j in "${js[@]}"; do
    [ "$(left)" -gt 10 ] || { el "$j: not started, the deadline has come"; continue; }
    el "$j starts on GPU $gpu"
    CUDA_VISIBLE_DEVICES=$gpu timeout -s KILL "$(left)" bash -c "job $j"
    el "$j ended with status $?"
  done
}
if [ "$ngpu" -gt 1 ]; then
  for i in "${!lanes[@]}"; do run_lane "$i" & done
  wait
else
  for i in "${!lanes[@]}"; do run_lane "$i"; done
fi
[ -d "$W/study" ] && pack   # what the study has, finished or cut off at the deadline
ls -la "$OUT" "$OUT"/14b-* "$OUT/floors" 2>/dev/null
tail -n 12 "$OUT/sagebwd.log" 2>/dev/null
grep -h "^==\|ratio\|sagebwd\|bf16" "$OUT/floors.log" 2>/dev/null | tail -n 16
grep -h -E "all-correct|Error|stopped|done:" "$W"/study/logs/*.log 2>/dev/null | tail -n 20
tail -q -n 8 "$W"/14b-*.log 2>/dev/null
