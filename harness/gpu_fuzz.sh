#!/usr/bin/env bash
# Run the configuration fuzzer (harness/fuzz.py) on a GPU host for each
# variant side by side on one GPU (one process per variant, the same seed:
# the same configurations), then a summary per run file: configurations
# tried, refused, invalid, failed, and each failure's first divergence.
#
#   bash harness/gpu_fuzz.sh VARIANTS DEADLINE_S SEED
#   e.g. bash harness/gpu_fuzz.sh "fork upstream" 420 1
#
# Failures run again alone (another stack, both variants, tracebacks kept):
#
#   python -m harness.fuzz regroup RUN.jsonl... --out GROUP_DIR [--ids ID,...] [--twin]
#   bash harness/gpu_fuzz.sh rerun "fork upstream" GROUP_DIR DEADLINE_S
#
# Shrinking a failure is a second phase, one variant, resumable across calls
# (the state file beside the run file): the minimal failing configuration
# is written to harness/regressions/ (copied to $OUT/regressions):
#
#   bash harness/gpu_fuzz.sh shrink VARIANT RUN.jsonl ID DEADLINE_S
#
# GROUP (default 6): configurations per child process (one reference, one
# teacher-forced verification each); JOBS (default 1): processes per
# variant, seeds SEED, SEED+1, ... The processes go round-robin over the
# host's GPUs (harness/gpu_slots.sh): on a host of several, JOBS can grow
# with its CPU cores.
#
# Needs the bundle installed at /tmp/hybridspec (hsfork/install_bundle.sh);
# the upstream tree is the fork's site with the series reversed
# (harness/upstream_site.sh). JSON lines in $OUT/fuzz/<variant>-s<seed>.jsonl
# (a line per configuration started and finished: a killed call keeps what
# it wrote), FUZZ.md beside them (fork and upstream outcomes of each
# configuration side by side), logs in $OUT/logs.
set -u
R=$PWD
OUT=${OUT:-$R/out}
# shellcheck disable=SC1091
source "$R/harness/upstream_site.sh"
if [[ ${1:-} == shrink ]]; then
  V=$2 RUN=$3 ID=$4 DEADLINE=${5:-420}
  mkdir -p "$OUT/regressions"
  prepare_variants "$V" 0.2 || exit 1
  in_variant "$V" timeout -k 15 $((DEADLINE + 400)) \
    python3 -m harness.fuzz shrink "$RUN" --id "$ID" --deadline "$DEADLINE" \
    --per-call "${GROUP:-4}"
  cp -n "$R"/harness/regressions/*.json "$OUT/regressions/" 2>/dev/null
  exit 0
fi
MODE=fuzz
if [[ ${1:-} == rerun ]]; then
  # bash harness/gpu_fuzz.sh rerun VARIANTS GROUP_DIR DEADLINE_S: each group
  # file (python -m harness.fuzz regroup) alone, for each variant, all at once
  MODE=rerun VARIANTS=$2 GROUP_DIR=$3 DEADLINE=${4:-300}
  prepare_variants "$VARIANTS" 0.05 || exit 1
else
  VARIANTS=${1:-fork} DEADLINE=${2:-420} SEED=${3:-0}
  prepare_variants "$VARIANTS" 0.1 || exit 1
fi
flashinfer_for ""
mkdir -p "$OUT/fuzz" "$OUT/logs"
# shellcheck disable=SC1091
source "$R/harness/pack_out.sh"
# shellcheck disable=SC1091
source "$R/harness/gpu_slots.sh"
# a call killed at its limit still returns the run files written so far
[ "${HS_PACK:-1}" = 1 ] && pack_start "$MODE" fuzz logs
pids=()
for v in $VARIANTS; do
  name=${v//+/-with-}
  if [[ $MODE == rerun ]]; then
    for g in "$GROUP_DIR"/*.json; do
      id=$(basename "$g" .json)
      on_gpu ${#pids[@]} in_variant "$v" timeout -k 15 $((DEADLINE + 60)) \
        python3 -m harness.fuzz run-group "$g" \
        --out "$OUT/fuzz/rerun-$name-$id.jsonl" --deadline "$DEADLINE" \
        > "$OUT/logs/rerun-$name-$id.log" 2>&1 &
      pids+=($!)
      sleep 2
    done
    continue
  fi
  # JOBS processes per variant, seeds SEED, SEED+1, ...: every variant runs
  # the same configurations
  for ((j = 0; j < ${JOBS:-1}; j++)); do
    s=$((SEED + j))
    on_gpu ${#pids[@]} in_variant "$v" timeout -k 15 $((DEADLINE + 150)) \
      python3 -m harness.fuzz run --out "$OUT/fuzz" --variant "$name" \
      --seed "$s" --deadline "$DEADLINE" --group "${GROUP:-6}" \
      > "$OUT/logs/fuzz-$name-s$s.log" 2>&1 &
    pids+=($!)
    sleep 2
  done
done
for p in "${pids[@]}"; do wait "$p"; done
python3 -m harness.fuzz report "$OUT/fuzz" > /dev/null
python3 - "$OUT/fuzz" <<'EOF'
import json, sys
from pathlib import Path
from harness.fuzz import read_lines, summary
for f in sorted(Path(sys.argv[1]).glob("*.jsonl")):
    if f.stem.endswith("-shrink"):
        continue
    s = summary(read_lines(f))
    print(f"== {f.stem}: {s['tried']} tried, {json.dumps(s['counts'])}")
    for x in s["failures"]:
        what = x["first_divergence"] or (x["error"] or "")[-200:].replace("\n", " ")
        print(f"   {x['id']} {x['kind'] or x['status']}: {what}")
        print(f"      {json.dumps(x['config'])}")
EOF
# A lent GPU host returns at most 8 files of $OUT, and its next call empties
# $OUT: the run files, report and logs travel as one archive (HS_PACK=0
# keeps the files as they are).
if [ "${HS_PACK:-1}" = 1 ]; then
  pack_final "$MODE" fuzz logs && echo "report: FUZZ.md in $OUT/$MODE-*.tgz"
else
  echo "report: $OUT/fuzz/FUZZ.md"
fi
