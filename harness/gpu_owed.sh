#!/usr/bin/env bash
# Run the cells a line's support table still owes, and nothing else, on a GPU
# host: fork and upstream side by side, as harness/gpu_matrix.sh runs them.
#
#   bash harness/gpu_owed.sh VARIANTS DEADLINE_S
#   e.g. HSFORK_GPU_MEM=0.05 bash harness/gpu_owed.sh "fork upstream" 300
#
# The list is `python -m harness support-table --line LINE --readme README.md
# --owed` (the cells without a result, and the speculative cells judged
# before a rule that judges them otherwise now; HS_OWED: a list of one's
# own, in that format), LINE the installed bundle's (HS_LINE to name it).
# It is cut in two:
# - single-GPU cells: one gpu_matrix.sh over the host's GPUs (HS_GPUS, else
#   every GPU);
# - cells at tensor_parallel_size 2: one gpu_matrix.sh over a pair of GPUs
#   (HS_TP_GPUS, default "0,1"). On a host of one GPU they are left out, and
#   said so.
# Each owed cell gets a process of its own, and each process HS_CELL_S
# (600) s past DEADLINE: a TP=2 cell with its same-TP reference and prefill
# takes 400-580 s, and on a loaded host (2026-11-28: load 38-43 on 32 cores,
# beside the TP cells) single-GPU processes of 2 cells each, FP8 and
# FlashInfer's JIT among them, reached a 470 s limit before their first
# report: a process writes its report once all its cells are verified, so
# a killed process leaves none.
# Both halves run at once, their reports under $OUT/single and $OUT/tp.
# HS_DRY=1 prints the two gpu_matrix.sh commands instead of running them.
# Why by hand: the table, the list and gpu_matrix.sh are this project's own;
# this is the glue a GPU call repeated by hand each time.
set -u
R=$PWD
VARIANTS=${1:-fork upstream}
DEADLINE=${2:-300}
OUT=${OUT:-$R/out}
mkdir -p "$OUT"
LINE=${HS_LINE:-$(python3 -c 'import json, sys; print("v" + json.load(open(sys.argv[1]))["version"].split("+")[0])' "${HS_HOME:-/tmp/hybridspec}/manifest.json")}
OWED=${HS_OWED:-$OUT/owed-$LINE.jsonl}
if [ -z "${HS_OWED:-}" ]; then
  python3 -m harness support-table --line "$LINE" --readme "$R/README.md" --owed > "$OWED" || exit 1
fi
# the two halves' lists, and their gpu_matrix.sh slice entries (line 1:
# single-GPU, line 2: TP)
mapfile -t plan < <(python3 - "$OWED" "$OUT/owed-single.jsonl" "$OUT/owed-tp.jsonl" <<'PY'
import collections
import json
import sys

src, single, tp = sys.argv[1:]
n = {False: collections.Counter(), True: collections.Counter()}
with open(single, "w") as fs, open(tp, "w") as ft:
    for line in open(src):
        if not line.strip():
            continue
        cell = json.loads(line)
        par = int((cell.get("engine") or {}).get("tensor_parallel_size") or 1) > 1
        (ft if par else fs).write(line if line.endswith("\n") else line + "\n")
        n[par][cell["slice"]] += 1
print(" ".join(f"{s}:{k}" for s, k in n[False].items()))
print(" ".join(f"{s}:{k}" for s, k in n[True].items()))
PY
)
single=${plan[0]:-} tp=${plan[1]:-}
echo "[owed] $LINE: single-GPU: ${single:-none}; TP: ${tp:-none}"
# shellcheck disable=SC1091
source "$R/harness/gpu_slots.sh"
read -r -a gpus <<< "$(gpu_list)"
run() {  # NAME CELLS SLICES [VAR=VALUE...]: one gpu_matrix.sh call
  local name=$1 cells=$2 slices=$3
  shift 3
  local cmd=(env "$@" HS_CELLS="$cells" OUT="$OUT/$name"
             bash "$R/harness/gpu_matrix.sh" "$VARIANTS" "$slices" "$DEADLINE")
  if [ "${HS_DRY:-0}" = 1 ]; then
    echo "[owed] ${cmd[*]}"
  else
    "${cmd[@]}" > "$OUT/$name.log" 2>&1 &
    pids+=($!)
  fi
}
pids=()
[ -n "$single" ] && run single "$OUT/owed-single.jsonl" "$single" HS_CELL_S="${HS_CELL_S:-600}"
if [ -n "$tp" ]; then
  if ((${#gpus[@]} >= 2)); then
    run tp "$OUT/owed-tp.jsonl" "$tp" HS_GPUS="${HS_TP_GPUS:-0,1}" HS_CELL_S="${HS_CELL_S:-600}"
  else
    echo "[owed] left out: the TP cells need 2 GPUs, this host has ${#gpus[@]}"
  fi
fi
for p in "${pids[@]}"; do wait "$p"; done
for f in "$OUT"/single.log "$OUT"/tp.log; do
  [ -f "$f" ] && { echo "== $f"; tail -20 "$f"; }
done
exit 0
