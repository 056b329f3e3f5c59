#!/usr/bin/env bash
# lm-eval for the GPU host, which has no network: lm_eval 0.4.13 and the
# wheels it needs that the host image (hsfork/gpu_host_packages.txt) and the
# bundle (/tmp/hybridspec/deps) lack, kept in .whl-lmeval/ (ignored by git;
# name it in the GPU call's `carry`).
#
#   bash serving/install_lm_eval.sh download      # here: fetch the wheels
#   bash serving/install_lm_eval.sh [TARGET]      # host: install, no index
#   export PYTHONPATH=$PYTHONPATH:/tmp/lmeval-site
#
# The set is what `lm_eval run --model local-completions|local-chat-completions
# --tasks fastapply` imports (checked on a CPU host against the host's
# package list, see tests/test_serving.py): lm_eval's declared dependencies
# rouge-score, sqlitedict, word2number, more-itertools are not imported on
# that path and are left out (the first three have no wheel for the host or
# pull nltk); evaluate is declared and small, and kept.
set -euo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
WHL=${LMEVAL_WHEELS:-$R/.whl-lmeval}
WHEELS=(
  lm_eval==0.4.13
  datasets==5.2.0
  evaluate==0.4.6
  multiprocess==0.70.19
  tenacity==9.2.1
  pytablewriter==1.2.1
  DataProperty==1.1.1
  mbstrdecoder==1.1.5
  pathvalidate==3.3.1
  tabledata==1.3.5
  tcolorpy==0.1.7
  typepy==1.3.5
  chardet==6.0.0.post1
  pytz==2026.6
)
PY=${PYTHON:-python3}
if [[ ${1:-} == download ]]; then
  mkdir -p "$WHL"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHL" "${WHEELS[@]}"
  ls -l "$WHL"
  exit 0
fi
TARGET=${1:-/tmp/lmeval-site}
shopt -s nullglob
files=("$WHL"/*.whl)
if ((${#files[@]} != ${#WHEELS[@]})); then
  echo "install_lm_eval: expected ${#WHEELS[@]} wheels in $WHL, found ${#files[@]}" >&2
  echo "  (run 'bash serving/install_lm_eval.sh download' here and carry .whl-lmeval)" >&2
  exit 1
fi
# LMEVAL_PIP_EXTRA: e.g. "--python-version 3.12 --only-binary=:all:" to
# unpack the cp312 set with another Python (the CPU test does)
# shellcheck disable=SC2086
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
  --disable-pip-version-check --upgrade --target "$TARGET" ${LMEVAL_PIP_EXTRA:-} "${files[@]}"
echo "[lm-eval] installed into $TARGET; use: export PYTHONPATH=\$PYTHONPATH:$TARGET"
