#!/usr/bin/env bash
# One self-contained device call of the v7 development study (docs/repro/v7.md): trains RUNS (one
# process per run and seed, all on the one GPU at once), exports them, evaluates them on the
# development prompts EVAL_OFFSET..+EVAL_PROMPTS-1 (NVFP4 and BF16 attention; base BF16 and NVFP4),
# probes the base per layer at three clip sizes (PROBE_SIZES=1), and packs every record into
# $OUT/v7-TAG.tar.gz. Environment: TAG RUNS SEEDS STEPS LR EMA EVAL_OFFSET EVAL_PROMPTS TRAIN_MIN.
set -u
# EVAL_S: seconds each evaluation process may take (finished configurations are kept)
export PYTHONUNBUFFERED=1
W=/tmp/v7-$TAG
T0=$(date +%s)
el() { echo "[v7 $(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null
DEV=${DEVICE:-cuda}
COMMON=(--work "$W" --model "${MODEL:-assets/tiny-wan}" --steps "$STEPS" --batch-size 32 --lr "$LR" --warmup 20
        --ema "$EMA" --two-objects 0.8 --workers 2 --device "$DEV" --no-progress
        --eval-offset "$EVAL_OFFSET" --eval-prompts "$EVAL_PROMPTS" --eval-batch "$EVAL_PROMPTS"
        --eval-backend auto)
pids=()
if [ "${PROBE_SIZES:-0}" = 1 ]; then
  for fs in "33 128" "65 128" "33 192"; do
    set -- $fs
    attnqat repro --work /tmp/probe-f$1-s$2 --stages probe --runs attnqat --frames $1 --size $2 \
      --probe-prompts "${PROBE_PROMPTS:-8}" --eval-offset "$EVAL_OFFSET" --eval-batch 8 --device "$DEV" \
      --model "${MODEL:-assets/tiny-wan}" \
      > "$W.probe-f$1-s$2.log" 2>&1 &
  done
fi
mkdir -p "$W"
for r in ${RUNS//,/ }; do for s in ${SEEDS//,/ }; do
  attnqat repro "${COMMON[@]}" --runs "$r" --seeds "$s" --stages train --time-limit "$TRAIN_MIN" \
    > "$W/train-$r-s$s.log" 2>&1 &
  pids+=($!)
done; done
wait "${pids[@]}"
el "training done"
for d in "$W"/runs/*/; do
  k=$(basename "$d")
  if [ ! -f "$W/export/$k/attnqat.json" ]; then
    el "run $k paused before its last step: exporting its last checkpoint"
    attnqat finetune export "$d" --out "$W/export/$k" > /dev/null 2>&1 || el "export of $k failed"
  fi
  tail -n 1 "$d/log.jsonl" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('  $k step', r.get('step'), 'loss', r.get('loss'), 'step_s', r.get('step_s'))"
done
# the per-layer NVFP4 error probe of the base and every export (first 8 development prompts)
timeout "${PROBE_TIMEOUT:-240}" attnqat repro "${COMMON[@]}" --runs "$RUNS" --seeds "$SEEDS" --stages probe \
  --probe-prompts "${PROBE_PROMPTS:-8}" --eval-batch 8 > "$W/probe-arms.log" 2>&1 &
# evaluation: the base in one process, each fine-tuned run (all its seeds) in another
epids=()
timeout "${EVAL_S:-240}" attnqat repro "${COMMON[@]}" --runs "$RUNS" --seeds "$SEEDS" --stages eval --configs base-bf16,base-nvfp4 \
  --workers 4 > "$W/eval-base.log" 2>&1 &
epids+=($!)
for i in $(seq 240); do   # the base BF16 reference clips: made once, by the first process
  ls "$W"/cache/base-bf16-*.npy > /dev/null 2>&1 && break; sleep 1; done
for r in ${RUNS//,/ }; do for s in ${SEEDS//,/ }; do   # one process per run and seed
  case $r in attnqat) c=qat;; bf16) c=control;; *) c=$r;; esac
  timeout "${EVAL_S:-240}" attnqat repro "${COMMON[@]}" --runs "$r" --seeds "$s" --stages eval \
    --configs "$c-nvfp4,$c-bf16" --workers 2 > "$W/eval-$r-s$s.log" 2>&1 &
  epids+=($!)
done; done
wait "${epids[@]}"
el "evaluation done"
wait
for p in /tmp/probe-f*; do [ -f "$p/probe.json" ] && cp "$p/probe.json" "$W/$(basename $p).json"; done
cp "$W".probe-*.log "$W"/ 2>/dev/null
attnqat repro "${COMMON[@]}" --runs "$RUNS" --seeds "$SEEDS" --stages report --doc "$W/report.md" > "$W/report.log" 2>&1
tar czf "$OUT/v7-$TAG.tar.gz" -C /tmp --exclude='checkpoints' --exclude='cache' --exclude='*.safetensors' \
  --exclude='tb' "v7-$TAG"
ls -la "$OUT"
el "packed"
grep -h -E "all-correct|probe base|stopped|Error|error" "$W"/*.log | tail -n 40
sed -n '/## Paired comparisons/,/## The protocol/p' "$W/report.md" | head -n 30
