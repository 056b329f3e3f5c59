#!/usr/bin/env bash
# Make the installed bundle's FlashInfer importable or not, for the calls
# that test it and the ones that do not.
#
#   bash hsfork/flashinfer_toggle.sh off|on|status [DEPS]
#
# DEPS: the bundle's dependency folder (default /tmp/hybridspec/deps, where
# hsfork/install_bundle.sh puts the wheels). `off` moves `flashinfer` and its
# `flashinfer_python-*.dist-info` into DEPS/../flashinfer-off, `on` moves
# them back; both are no-ops when there is nothing to move. Why: with
# FlashInfer importable, every vLLM engine autotunes and JIT-compiles what it
# uses at start (the bundle carries no flashinfer-cubin), so sixteen
# processes sharing a GPU timed out before their first step. vLLM has no
# switch for this: `--kernel-config '{"enable_flashinfer_autotune": false}'`
# skips only the autotuner, not the kernels FlashInfer JIT-compiles, and
# has_flashinfer() looks the package up by name (importlib.util.find_spec),
# so only its absence turns it off (a stub that fails to import would be
# taken as present).
set -euo pipefail
MODE=${1:?off, on or status}
DEPS=${2:-/tmp/hybridspec/deps}
OFF=$(dirname "$DEPS")/flashinfer-off
[ -d "$DEPS" ] || { echo "error: no bundle dependency folder $DEPS" >&2; exit 2; }
present() { [ -d "$1/flashinfer" ]; }
move() {  # the package and its dist-info, from $1 to $2
  local p
  mkdir -p "$2"
  for p in "$1"/flashinfer "$1"/flashinfer_python-*.dist-info; do
    [ -e "$p" ] && mv "$p" "$2"/
  done
  return 0
}
case $MODE in
  off) if present "$DEPS"; then move "$DEPS" "$OFF"; fi ;;
  on) if present "$OFF"; then move "$OFF" "$DEPS"; fi ;;
  status) ;;
  *) echo "usage: $0 off|on|status [DEPS]" >&2; exit 2 ;;
esac
if present "$DEPS"; then echo "flashinfer: on ($DEPS)"; else echo "flashinfer: off"; fi
