#!/usr/bin/env bash
# Sourced by serving/gpu_serve.sh (PREFIX=SERVE) and
# benchmarks/gpu_serve_bench.sh (PREFIX=BENCH), with R = the repo root and
# NAME = the calling script: the bundle's environment, the Python to run
# (PY), and the `vllm serve` flags every Qwen3.5 server on these hosts needs
# (ENGINE). Reads ${PREFIX}_BUNDLE_ENV (default /tmp/hybridspec/env.sh;
# "none" skips it), ${PREFIX}_ENGINE (extra flags), ${PREFIX}_EAGER=1.
_var=${PREFIX}_BUNDLE_ENV
_env=${!_var:-/tmp/hybridspec/env.sh}
if [[ $_env != none ]]; then
  # shellcheck disable=SC1090
  source "$_env" || {
    echo "$NAME: no bundle at /tmp/hybridspec (install it first)" >&2
    exit 2
  }
fi
PY=${PYTHON:-python3}
export PYTHONPATH="$R${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
# serve_check splits these with shlex: the JSON keeps its quotes inside ''
QWEN35="--gdn-prefill-backend triton --language-model-only --limit-mm-per-prompt '{\"image\":0,\"video\":0}'"
_var=${PREFIX}_ENGINE
ENGINE="$QWEN35 --disable-uvicorn-access-log ${!_var:-}"
_var=${PREFIX}_EAGER
[[ ${!_var:-0} == 1 ]] && ENGINE="$ENGINE --enforce-eager"
unset _var _env
