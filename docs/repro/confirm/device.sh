#!/usr/bin/env bash
# The confirmatory run of docs/repro/protocol.md §9, on one lent GPU (a copy of the tree without
# .git: ATTNQAT_PROTOCOL_COMMIT="COMMIT BLOB" names the committed protocol the guard checks).
#   PHASE=train : trains the candidate (run qad, seeds 0-2, all three at once), exports, then
#                 starts the evaluation of prompts 900-1399
#   PHASE=eval  : continues the evaluation in the same work folder (a later command on the same
#                 machine): configurations already recorded are skipped, never redone
#   PHASE=probe : the per-layer NVFP4 error probe of the base and each export (development
#                 prompts 0-15, never confirmatory ones), then the report
# Every phase stops its evaluation processes DEADLINE seconds after it started (a configuration
# cut off is evaluated from its start by the next phase) and packs every record into $OUT.
set -u
export PYTHONUNBUFFERED=1
W=/tmp/confirm
T0=$(date +%s)
el() { echo "[confirm $(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null
SEEDS=0,1,2
COMMON=(--work "$W" --model assets/tiny-wan --runs qad --steps 200 --batch-size 32 --lr 2e-5 --warmup 20
        --ema 0.98 --two-objects 0.8 --device cuda --no-progress
        --eval-offset 900 --eval-prompts 500 --eval-batch 250 --eval-backend auto)
mkdir -p "$W/logs"
if [ "$PHASE" = train ]; then
  pids=()
  for s in ${SEEDS//,/ }; do
    attnqat repro "${COMMON[@]}" --seeds "$s" --workers 4 --stages train --time-limit 5 \
      > "$W/logs/train-qad-s$s.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  el "training done"
  for s in ${SEEDS//,/ }; do
    [ -f "$W/export/qad-s$s/attnqat.json" ] || { el "qad-s$s has no export: stopping"; exit 3; }
    tail -n 1 "$W/runs/qad-s$s/log.jsonl"; echo
  done
fi
if [ "$PHASE" = train ] || [ "$PHASE" = eval ]; then
  EVAL_S=$(( DEADLINE - ($(date +%s) - T0) ))
  el "evaluating for at most $EVAL_S s"
  epids=()
  # the base's BF16 clips (every record's reference) and its naive NVFP4: one process
  timeout -s KILL "$EVAL_S" attnqat repro "${COMMON[@]}" --seeds "$SEEDS" --stages eval --configs base-bf16,base-nvfp4 \
    --workers 3 >> "$W/logs/eval-base.log" 2>&1 &
  epids+=($!)
  for i in $(seq "$EVAL_S"); do   # the others start once the base's BF16 clips are cached
    ls "$W"/cache/base-bf16-*.npy > /dev/null 2>&1 && break
    kill -0 "${epids[0]}" 2> /dev/null || { el "the base's evaluation ended early"; break; }
    sleep 1; done
  timeout -s KILL "$EVAL_S" attnqat repro "${COMMON[@]}" --seeds "$SEEDS" --stages eval --configs base-sage3 \
    --workers 3 >> "$W/logs/eval-sage3.log" 2>&1 &
  epids+=($!)
  for s in ${SEEDS//,/ }; do
    timeout -s KILL "$EVAL_S" attnqat repro "${COMMON[@]}" --seeds "$s" --stages eval --configs qad-nvfp4,qad-bf16 \
      --workers 3 >> "$W/logs/eval-qad-s$s.log" 2>&1 &
    epids+=($!)
  done
  wait "${epids[@]}"
  el "evaluation phase ended"
fi
if [ "$PHASE" = probe ]; then
  attnqat repro "${COMMON[@]}" --seeds "$SEEDS" --stages probe --eval-offset 0 --probe-prompts 16 \
    --eval-batch 16 > "$W/logs/probe.log" 2>&1
  attnqat repro "${COMMON[@]}" --seeds "$SEEDS" --stages report --doc "$W/report.md" > "$W/logs/report.log" 2>&1
  el "probe and report done"
fi
ls "$W/eval"
tar czf "$OUT/confirm-$PHASE.tar.gz" -C /tmp --exclude='checkpoints' --exclude='cache' --exclude='*.safetensors' \
  --exclude='tb' confirm
if [ -f "$W/export/qad-s0/diffusion_pytorch_model.safetensors" ]; then   # the ship rule's weights, in parts
  split -b 15M "$W/export/qad-s0/diffusion_pytorch_model.safetensors" "$OUT/qad-s0.safetensors.part-"
fi
ls -la "$OUT"
grep -h -E "all-correct|stopped|Error|error|refus" "$W"/logs/*.log | tail -n 30
