#!/usr/bin/env bash
# Does one Attn-QAT training step of the Wan 2.1 14B transformer at 480p, 81 frames fit on ONE GPU?
# (docs/benchmarks.md, "14B on one GPU"). Self-contained device script: runs each row of the table
# as its own process (`attnqat bench train --config 14b`, random weights, batch 1, gradient
# checkpointing, bf16 autocast), each under its own time limit, and writes three files into $OUT
# (the lent GPU returns at most 8), each brought up to date after every row:
#   14b_one_gpu.json  the rows' records by row name: bench train's own, or, for a process that was
#                     killed, one written here ("does not fit: host out of memory ..." for SIGKILL,
#                     the kernel's OOM killer's signal; "did not finish within N s" at the limit)
#   14b_one_gpu.log   every row's output;   env.txt  GPU, host memory, versions
# and prints a short table last. A row that runs out of GPU or host memory ends with a one-line
# "does not fit" record and the next row starts. The rows' own files are in $WORK.
#
#   OUT=/tmp/out bash docs/benchmarks/14b_one_gpu.sh
#
# Environment: OUT (required); ROWS (comma-separated, default all four below, in that order);
# BUDGET_S (seconds for all rows together, default 400: each row's limit is cut to what is left, and
# a row with under MIN_ROW_S (default 45) s left is recorded as not run); ROW_LIMIT_S (each row's
# own limit instead of the defaults below, still cut to the budget left); WORK (default
# /tmp/14b_one_gpu); PYTHON (default python3); CONFIG (default 14b) and EXTRA (more bench train
# arguments) only for trying the script itself on a small model, e.g.
# CONFIG=tiny EXTRA="--device cpu --resolution 32x32 --frames 5" (tests/test_bench_train_14b.py).
set -u
OUT=${OUT:?set OUT to the folder for the records}
W=${WORK:-/tmp/14b_one_gpu}
mkdir -p "$OUT" "$W"
: > "$OUT/14b_one_gpu.log"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1   # -P: the repository root holds attnqat/, a part of the package
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-400}
MIN_ROW=${MIN_ROW_S:-45}
ROWS=${ROWS:-lora32,lora32-offload,full-offload-8bit,full-8bit}
CONFIG=${CONFIG:-14b}
EXTRA=${EXTRA:-}
T0=$(date +%s)
el() { echo "[14b $(( $(date +%s) - T0 )) s] $*"; }

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  free -g 2>&1 | head -2
  echo "cgroup memory.max: $(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo none)"
  nproc
  $PY -c "
from importlib.metadata import version
for n in ('torch', 'triton', 'diffusers', 'peft', 'accelerate', 'transformers'):
    try:
        print(n, version(n), end='  ')
    except Exception:
        print(n, 'MISSING', end='  ')
print()" 2>&1
} | tee "$OUT/env.txt"
R0=$(date +%s)   # the rows' budget starts here

oom_kills() { awk '$1 == "oom_kill" {print $2; f = 1} END {if (!f) print 0}' /sys/fs/cgroup/memory.events 2>/dev/null || echo 0; }

# row NAME LIMIT_S ARGS...: one bench train process; its host RSS sampled every second
row() {
  local name=$1 limit=$2; shift 2
  local json="$W/$name.json" log="$W/$name.log"
  local left=$(( BUDGET - ($(date +%s) - R0) ))
  rm -f "$json"
  if [ "$left" -lt "$MIN_ROW" ]; then
    el "$name: not run (${left} s of the ${BUDGET} s budget left)" | tee -a "$OUT/14b_one_gpu.log"
    $PY - "$json" "$name" "$*" "$CONFIG" <<'PY'
import json, sys
json.dump({"config": sys.argv[4], "row": sys.argv[2], "args": sys.argv[3], "rows": [
    {"method": "attnqat", "fits": None, "not_run": "out of time in the script's budget"}]},
    open(sys.argv[1], "w"), indent=1)
PY
    return
  fi
  limit=${ROW_LIMIT_S:-$limit}
  [ "$limit" -gt "$left" ] && limit=$left
  el "$name: attnqat bench train --config $CONFIG $* $EXTRA (limit ${limit} s)"
  local k0 t1 pid rss peak=0 last=0 killed=0
  k0=$(oom_kills)
  t1=$(date +%s)
  # shellcheck disable=SC2086  # EXTRA: words
  $PY -m attnqat.cli bench train --config "$CONFIG" --resolution 480p --frames 81 --methods attnqat \
      --json "$json" "$@" $EXTRA > "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null)
    if [ -n "$rss" ]; then last=$rss; [ "$rss" -gt "$peak" ] && peak=$rss; fi
    if [ $(( $(date +%s) - t1 )) -ge "$limit" ] && [ "$killed" = 0 ]; then
      killed=1; kill -TERM "$pid" 2>/dev/null
      for _ in 1 2 3 4 5; do kill -0 "$pid" 2>/dev/null && sleep 1; done
      kill -KILL "$pid" 2>/dev/null
    fi
    sleep 1
  done
  wait "$pid"
  local rc=$?
  grep "^$CONFIG attnqat (" "$log" || tail -n 3 "$log"
  $PY - "$json" "$log" "$name" "$rc" "$(( $(date +%s) - t1 ))" "$limit" "$killed" "$peak" "$last" \
      "$k0" "$(oom_kills)" "$CONFIG" "$* $EXTRA" <<'PY'
import json, sys
from pathlib import Path

path, log, name, rc, elapsed, limit, killed, peak, last, k0, k1, config, args = sys.argv[1:]
rc, elapsed, limit, killed, k0, k1 = map(int, (rc, elapsed, limit, killed, k0, k1))
peak, last = int(peak) / 2**20, int(last) / 2**20            # KiB -> GiB
p = Path(path)
rec = json.loads(p.read_text()) if p.exists() else None
if rec is None or not rec.get("rows"):
    lines = Path(log).read_text(errors="replace").splitlines() if Path(log).exists() else []
    phases = [x.split(": ", 1)[1] for x in lines if x.startswith("bench train [") and ": " in x]
    where = phases[-1] if phases else "starting"
    if killed:
        why, fits = (f"did not finish within {limit} s (last: {where}; host RSS {last:.1f} GiB at "
                     f"the last one-second sample, {peak:.1f} GiB at most)"), None
    elif rc in (137, -9) or k1 > k0:
        seen = (f"the kernel's OOM killer ended it (cgroup oom_kill count +{k1 - k0})" if k1 > k0 else
                "presumably the kernel's OOM killer (the cgroup's oom_kill count did not show it)")
        why = (f"host out of memory: killed by SIGKILL (exit {rc}), {seen}, while {where}; host RSS "
               f"{last:.1f} GiB at the last one-second sample, {peak:.1f} GiB at most")
        fits = False
    else:
        tail = next((x.strip() for x in reversed(lines) if x.strip()), "no output")
        why, fits = f"failed (exit {rc}) while {where}: {tail[:240]}", None
    row = {"method": "attnqat", "fits": fits, "host_rss_last_sample_gib": last,
           "host_rss_max_sample_gib": peak, "exit": rc, "elapsed_s": elapsed}
    row["does_not_fit" if fits is False else "error"] = why
    rec = {"config": config, "command": ["attnqat", "bench", "train", "--config", config, *args.split()],
           "rows": [row]}
    print(f"{config} attnqat ({name}): " + ("does not fit: " if fits is False else "") + why)
rec.update(row=name, args=args, exit=rc, elapsed_s=elapsed, limit_s=limit,
           host_rss_max_sample_gib=peak)
p.write_text(json.dumps(rec, indent=1) + "\n")
PY
  { echo "=== $name: bench train $* $EXTRA (exit $rc)"; cat "$log"; } >> "$OUT/14b_one_gpu.log"
}

# combine: the records of the rows run so far, by row name, into $OUT/14b_one_gpu.json
combine() {
  $PY - "$W" "$OUT/14b_one_gpu.json" "$ROWS" <<'PY'
import json, sys
from pathlib import Path

w, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
recs = {n: json.loads((w / f"{n}.json").read_text()) for n in names if (w / f"{n}.json").exists()}
out.write_text(json.dumps(recs, indent=1) + "\n")
PY
}

for r in ${ROWS//,/ }; do rm -f "$W/$r.json"; done
for r in ${ROWS//,/ }; do
  case $r in
    lora32)            row "$r" 150 --lora-rank 32 --warmup 1 --steps 1 ;;
    lora32-offload)    row "$r" 180 --lora-rank 32 --offload --warmup 1 --steps 1 ;;
    # no warm-up: if it fits, the CPU optimizer step over 14.3 B float32 weights takes minutes
    full-offload-8bit) row "$r" 150 --offload --optimizer adamw8bit --warmup 0 --steps 1 ;;
    full-8bit)         row "$r" 90 --optimizer adamw8bit --warmup 0 --steps 1 ;;
    *) el "unknown row $r (rows: lora32, lora32-offload, full-offload-8bit, full-8bit)" ;;
  esac
  combine
done

el "done"
$PY - "$OUT/14b_one_gpu.json" "$CONFIG" <<'PY'
import json, sys
from pathlib import Path

recs, config = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
first = next((r for r in recs.values() if "device" in r), {"config": config})
print(f"\n{first['config']} Attn-QAT training step, {first.get('height', '?')}x{first.get('width', '?')}, "
      f"{first.get('frames', '?')} frames, batch 1, one GPU ({first.get('device', '?')}), {first.get('date', '?')}:")
head = (f"{'row':<18} {'fits':<5} {'step s':>7} {'GPU peak GiB':>13} {'host peak GiB':>14} {'in steps':>9} "
        f"{'build s':>8} {'setup s':>8}")
print(head)
print("-" * len(head))
f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"
for n, rec in recs.items():
    r = rec["rows"][0]
    fits = {True: "yes", False: "no", None: "?"}[r.get("fits")]
    host = r.get("host_peak_rss_gib", r.get("host_rss_max_sample_gib"))
    print(f"{n:<18} {fits:<5} {f(r.get('step_s'), 2):>7} {f(r.get('peak_memory_gib')):>13} {f(host):>14} "
          f"{f(r.get('host_steps_peak_rss_gib')):>9} {f(r.get('build_s')):>8} {f(r.get('trainer_setup_s')):>8}")
    note = r.get("does_not_fit") or r.get("error") or r.get("not_run")
    if note:
        print(f"{'':<18} {note}")
PY
