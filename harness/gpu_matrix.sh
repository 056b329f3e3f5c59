#!/usr/bin/env bash
# Run slices of the equivalence matrix on a GPU host, fork and unpatched
# upstream of the bundle's line (v0.26.0 or v0.33.0) side by side (one process per slice and variant, sharing the GPU).
#
#   bash harness/gpu_matrix.sh VARIANTS SLICES DEADLINE_S
#   e.g. bash harness/gpu_matrix.sh "fork upstream" "v1-matrix-q-state v1-matrix-n-state" 400
#
# A slice written SLICE:S has its cells dealt into S processes (reports
# SLICE-VARIANT-I-of-S.json; harness.full_matrix summarize merges them).
# The processes go round-robin over the host's GPUs (harness/gpu_slots.sh).
#
# Needs the bundle installed at $HS_HOME (/tmp/hybridspec; see
# harness/upstream_site.sh for a second line beside it).
# The upstream tree is the fork's site with the patch series reversed.
# Reports go to $OUT/equivalence, logs to $OUT/logs, both packed at the end
# into $OUT/equivalence-HHMMSS.tgz (HS_PACK=0: left as files).
# HS_ONLY: only the cells whose key contains this substring (harness.equivalence
# --only), e.g. HS_ONLY=synthetic for the sampled cells of synthetic acceptance.
# HS_CELLS: only the cells listed in this file (harness.equivalence --cells),
# e.g. the owed ones: python -m harness support-table --line L --readme
# README.md --not-run > owed.jsonl.
# HS_CELL_S (170): how long a process may run past DEADLINE (its last cell,
# the teacher-forced pass and the report) before it is killed as hung; a TP=2
# cell with its same-TP reference takes 450-520 s, so give the tp2 slice 600.
set -u
R=$PWD
VARIANTS=${1:-fork}
SLICES=${2:-v1-smoke}
DEADLINE=${3:-400}
OUT=${OUT:-$R/out}
mkdir -p "$OUT/equivalence" "$OUT/logs"
# shellcheck disable=SC1091
source "$R/harness/upstream_site.sh"
# shellcheck disable=SC1091
source "$R/harness/pack_out.sh"
# shellcheck disable=SC1091
source "$R/harness/gpu_slots.sh"
prepare_variants "$VARIANTS" 0.1 || exit 1
flashinfer_for "$SLICES"
# a call killed at its limit still returns the reports written so far
[ "${HS_PACK:-1}" = 1 ] && pack_start equivalence equivalence logs
pids=()
for v in $VARIANTS; do
  in_variant "$v" python3 -c \
    "import vllm; print('$v', vllm.__file__)"
  for entry in $SLICES; do
    # SLICE or SLICE:S (its cells dealt into S processes)
    s=${entry%%:*} n=1
    [[ $entry == *:* ]] && n=${entry#*:}
    for ((i = 1; i <= n; i++)); do
      run="$s-${v//+/-with-}" shard=()
      ((n > 1)) && run="$run-$i-of-$n" shard=(--shard "$i/$n")
      [[ -n ${HS_ONLY:-} ]] && shard+=(--only "$HS_ONLY")
      [[ -n ${HS_CELLS:-} ]] && shard+=(--cells "$HS_CELLS")
      HS_EXTRA_PATH=$(slice_path "$s") on_gpu ${#pids[@]} in_variant "$v" timeout -k 15 $((DEADLINE + ${HS_CELL_S:-170})) python3 -m harness.equivalence --slice "$s" \
        "${shard[@]}" --run "$run" --out "$OUT/equivalence" --deadline "$DEADLINE" \
        > "$OUT/logs/$run.log" 2>&1 &
      pids+=($!)
      sleep 2
    done
  done
done
for p in "${pids[@]}"; do wait "$p"; done
for f in "$OUT"/logs/*.log; do
  echo "== $f"; grep -E '^\{"(model|skipped)' "$f" | cut -c1-220
  grep -E "Traceback|Error" "$f" | tail -3
done
# A lent GPU host returns at most 8 files of $OUT, and its next call empties
# $OUT: this call's reports and logs travel as one archive (HS_PACK=0 keeps
# the files as they are).
if [ "${HS_PACK:-1}" = 1 ]; then
  pack_final equivalence equivalence logs
fi
