#!/usr/bin/env bash
# Run tests of the fork's tests/ tree on a GPU host, for the fork and for
# upstream v0.26.0 (the fork's site with the series reversed), one after the
# other: logs in $OUT/logs/unit-VARIANT.log, a pass/fail line each printed.
#
#   bash harness/gpu_unit_tests.sh "fork upstream" v1/worker/test_x.py ...
#
# Test paths are relative to the fork's tests/ (the bundle's repo/fork-tests).
set -u
R=$PWD
OUT=${OUT:-$R/out}
mkdir -p "$OUT/logs"
# shellcheck disable=SC1091
source "$R/harness/upstream_site.sh"
VARIANTS=$1
shift
# the fork's tests import themselves as the package `tests`
mkdir -p /tmp/forkroot && ln -sfn /tmp/hybridspec/repo/fork-tests /tmp/forkroot/tests
TESTS=()
for t in "$@"; do TESTS+=("tests/$t"); done
for v in $VARIANTS; do make_site "$v" || exit 1; done
# the offline hub cache the tests expect (generated configs, no weights)
export HSFORK_HF_CACHE=/tmp/hsfork-hub HF_HUB_CACHE=/tmp/hsfork-hub HF_HUB_OFFLINE=1
PYTHONPATH=$R:$PYTHONPATH python3 -m hsfork fixtures > /dev/null 2>&1 \
  || echo "hsfork fixtures failed: hub-named tests will error"
for v in $VARIANTS; do
  # shellcheck disable=SC2046
  (cd /tmp/forkroot && env $(variant_env "$v" /tmp/forkroot) \
    timeout 300 python3 -m pytest -p no:cacheprovider -q -rfE "${TESTS[@]}" \
    > "$OUT/logs/unit-$v.log" 2>&1)
  echo "== $v: $(grep -E '(passed|failed|error)' "$OUT/logs/unit-$v.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$OUT/logs/unit-$v.log" | cut -c1-200
done
