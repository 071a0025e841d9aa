#!/usr/bin/env bash
# The GPU runs issues 33 and 37 still need, as one device call: on nvidia-h200-x4 (or any machine
# with four GPUs) the four jobs run side by side, one GPU each, within DEADLINE seconds; on fewer
# GPUs name the jobs to run with JOBS (one call each fits the 10-minute limit). Device time is
# counted per machine held, not per GPU, so four GPUs for one call cost what one does.
#
#   sagebwd  GPU 0: tests/test_sagebwd_gpu.py, then kernels/sagebwd_bench.py --variants --profile
#            (the split's launches apart, dQ from stored dS; docs/benchmarks.md, "The backward's
#            structure") -> $OUT/sagebwd_bench.json, $OUT/sagebwd.log
#   lora     GPU 1: attnqat repro's LoRA study (docs/finetune.md, LoRA; development prompts
#            220-459 only) -> $OUT/lora.tar.gz (records, logs, report; no weights)
#   sbwd     GPU 2: attnqat repro's SageBwd fine-tuning rows (development prompts 460-699 only)
#            -> $OUT/sbwd.tar.gz
#   14b      GPU 3: docs/benchmarks/14b_one_gpu.sh, LoRA rows first (the frozen base is bf16 now)
#            -> $OUT/14b/14b_one_gpu.json, 14b_one_gpu.log, env.txt
# A job cut off by DEADLINE leaves what it finished: the repro jobs' work folders stay on a warm
# machine (a second call with the same JOBS continues them; repro skips what is done).
#
#   OUT=/tmp/out bash docs/benchmarks/open_runs.sh                # every job, GPUs 0-3
#   JOBS=sagebwd,14b OUT=/tmp/out bash docs/benchmarks/open_runs.sh
#
# The call begins with the wheel install of docs/development.md ("Running on the lent GPU").
# Environment: OUT (required), JOBS (default sagebwd,lora,sbwd,14b), DEADLINE (seconds, default
# 540), GPUS (the GPU of each job in JOBS order; default 0,1,2,... or all 0 on a one-GPU machine).
set -u
cd "$(dirname "$0")/../.." || exit 2   # the repository root
OUT=${OUT:?set OUT to the folder for the results}
JOBS=${JOBS:-sagebwd,lora,sbwd,14b}
DEADLINE=${DEADLINE:-540}
W=${WORK:-/tmp/open_runs}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$W"
T0=$(date +%s)
el() { echo "[open_runs $(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
IFS=, read -r -a jobs <<< "$JOBS"
if [ -n "${GPUS:-}" ]; then IFS=, read -r -a gpus <<< "$GPUS"; else
  gpus=(); for i in "${!jobs[@]}"; do gpus+=($(( ngpu > 1 ? i % ngpu : 0 ))); done; fi
el "$ngpu GPU(s); jobs ${jobs[*]} on GPUs ${gpus[*]}; deadline $DEADLINE s"

pack() {   # pack NAME FOLDER: records, logs and report of a study, without weights or caches
  tar czf "$OUT/$1.tar.gz" -C "$(dirname "$2")" --exclude='checkpoints' --exclude='cache' \
    --exclude='*.safetensors' --exclude='tb' "$(basename "$2")"
}
train_minutes() {   # what a repro job may train, leaving 4 minutes for its evaluation (at least 1)
  local m=$(( ($(left) - 240) / 60 )); [ "$m" -lt 1 ] && m=1; echo "$m"
}

job() {
  # the repro studies' shared settings (docs/repro.md, "Running a study"; development prompts only)
  local study=(--steps 200 --lr 2e-5 --warmup 20 --ema 0.98 --batch-size 32 --device cuda --no-progress
               --workers 4 --eval-batch 240 --eval-backend auto)
  case $1 in
    sagebwd)
      { python3 -P -m pytest -q -m gpu tests/test_sagebwd_gpu.py
        python3 -P -m attnqat.kernels.sagebwd_bench --variants --profile --rep-ms 250 \
          --json "$OUT/sagebwd_bench.json"; } > "$OUT/sagebwd.log" 2>&1 ;;
    lora)
      attnqat repro --work "$W/lora" --runs qad,qad-lora8,qad-lora32,qad-lora128 "${study[@]}" \
        --eval-offset 220 --eval-prompts 240 --time-limit "$(train_minutes)" > "$W/lora.log" 2>&1
      pack lora "$W/lora" ;;
    sbwd)
      attnqat repro --work "$W/sbwd" --runs sagebwd,bf16,attnqat "${study[@]}" \
        --eval-offset 460 --eval-prompts 240 --time-limit "$(train_minutes)" \
        --configs base-bf16,base-nvfp4,base-sagebwd,sbwd-sagebwd,sbwd-nvfp4,sbwd-bf16,qat-nvfp4,control-nvfp4,control-bf16 \
        > "$W/sbwd.log" 2>&1
      pack sbwd "$W/sbwd" ;;
    14b)
      OUT="$OUT/14b" ROWS=lora32,full-offload-8bit,lora32-offload,full-8bit \
        BUDGET_S=$(( $(left) - 60 )) bash docs/benchmarks/14b_one_gpu.sh > "$W/14b.log" 2>&1 ;;
    *) el "unknown job $1 (sagebwd, lora, sbwd, 14b)"; return 2 ;;
  esac
}
export -f el left pack train_minutes job
export OUT W DEADLINE T0

run_job() {   # run_job INDEX: job INDEX on its GPU, killed at the deadline
  CUDA_VISIBLE_DEVICES=${gpus[$1]} timeout -s KILL "$(left)" bash -c "job ${jobs[$1]}"
  el "${jobs[$1]} ended with status $?"
}
if [ "$ngpu" -gt 1 ]; then
  for i in "${!jobs[@]}"; do run_job "$i" & done
  wait
else   # one GPU for every job: one after the other
  for i in "${!jobs[@]}"; do run_job "$i"; done
fi
# a study killed at the deadline: pack what it finished
for s in lora sbwd; do [ -d "$W/$s" ] && [ ! -f "$OUT/$s.tar.gz" ] && pack "$s" "$W/$s"; done
ls -la "$OUT" "$OUT/14b" 2>/dev/null
tail -n 8 "$OUT/sagebwd.log" 2>/dev/null
for s in lora sbwd; do grep -h -E "all-correct|Error|error|stopped" "$W/$s.log" 2>/dev/null | tail -n 5; done
tail -n 8 "$W/14b.log" 2>/dev/null
