#!/usr/bin/env bash
# One of the six calls of the whole equivalence matrix (harness/full_matrix.py
# RUNS), fork and unpatched upstream of the bundle's line side by side, on a GPU
# host with the bundle installed at /tmp/hybridspec:
#
#   bash harness/gpu_full_matrix.sh N [DEADLINE_S]     # N = 1 to 6
#
# Reports and logs are packed into $OUT/equivalence-HHMMSS.tgz (gpu_matrix.sh);
# after the six calls, `python -m harness.full_matrix summarize DIR` over the
# reports of all four, unpacked into DIR.
set -u
N=${1:?run number 1 to 6}
DEADLINE=${2:-360}
SLICES=$(python3 -m harness.full_matrix slices "$N") || exit 1
# one process per slice (per shard of a SLICE:S) and variant share the GPU:
# each gets at most 0.07 of its memory, less where that would overcommit it
n=0
for e in $SLICES; do
  if [[ $e == *:* ]]; then n=$((n + ${e#*:})); else n=$((n + 1)); fi
done
share=$(python3 -c "print(round(min(0.07, 0.9 / (2 * $n)), 3))")
HSFORK_GPU_MEM=${HSFORK_GPU_MEM:-$share} exec bash "$(dirname "$0")/gpu_matrix.sh" \
  "fork upstream" "$SLICES" "$DEADLINE"
