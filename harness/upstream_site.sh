#!/usr/bin/env bash
# Source from a GPU-host script: makes the fork and unpatched upstream sites
# from the bundle's site, and defines `site_pythonpath VARIANT` that prints
# the PYTHONPATH for a variant, the repo first. Variants: fork (the line's
# whole series); upstream (no patch); upstream+NNNN[+MMMM...] (only the
# numbered patches).
#
# The bundle records in its manifest how many patches its site carries
# (version label `+hybridspec.pN`). A bundle of the unpatched base (p0) is
# the upstream site as it is, and the fork site is made by applying the
# repository's series to a copy: one bundle then serves every revision of
# the series. A bundle with the series in it is the fork site, and the
# upstream sites are made by reversing patches.
# Needs the bundle installed at $HS_HOME (/tmp/hybridspec) and R = the repo
# root.
#
# Two lines on one host at once: the other line's bundle installed beside
# the first (hsfork/gpu_stage.sh with HS_TARGET=/tmp/hybridspec-33), and its
# scripts started with HS_HOME=/tmp/hybridspec-33. Its variant sites and
# vLLM caches then go under $HS_HOME-sites (HS_SITE_ROOT), apart from the
# default line's under /tmp, so neither line's processes see the other's.
HS_HOME=${HS_HOME:-/tmp/hybridspec}
if [[ -z ${HS_SITE_ROOT:-} ]]; then
  if [[ $HS_HOME == /tmp/hybridspec ]]; then HS_SITE_ROOT=/tmp; else HS_SITE_ROOT=$HS_HOME-sites; fi
fi
export HS_HOME HS_SITE_ROOT
mkdir -p "$HS_SITE_ROOT"
# shellcheck disable=SC1091
source "$HS_HOME/env.sh"
# the series of the bundle's line (env.sh sets HSFORK_BASE)
PATCHES=${PATCHES:-$(cd "$R" && python3 -c 'from hsfork.common import patches_dir; print(patches_dir())')}
BUNDLE_SITE=$HS_HOME/site
BUNDLE_PATCHES=$(python3 -c '
import json, re, sys
try:
    v = json.load(open(sys.argv[1]))["version"]
except OSError:
    v = ""
m = re.search(r"\+hybridspec\.p(\d+)", v)
print(m[1] if m else -1)' "$HS_HOME/manifest.json")
_site_dir() {
  case $1 in
    fork) if ((BUNDLE_PATCHES == 0)); then echo "${HS_SITE_ROOT:-/tmp}/fork-site"; else echo "$BUNDLE_SITE"; fi ;;
    upstream) if ((BUNDLE_PATCHES == 0)); then echo "$BUNDLE_SITE"; else echo "${HS_SITE_ROOT:-/tmp}/upstream-site"; fi ;;
    *) echo "${HS_SITE_ROOT:-/tmp}/site-$1" ;;
  esac
}
_wanted() {  # is series entry $2 part of variant $1?
  local n
  [[ $1 == fork ]] && return 0
  for n in ${1//+/ }; do [[ $2 == "$n"-* ]] && return 0; done
  return 1
}
make_site() {
  # built in a folder of its own and renamed into place: scripts started
  # side by side in one call may make the same site at once, and none may
  # see another's half-patched copy (mv -T does not replace a site another
  # process finished first; that one is kept)
  local variant=${1:-upstream} dir series i tmp
  dir=$(_site_dir "$variant")
  [[ -d $dir ]] && return 0
  mapfile -t series < <(grep -v '^\s*$' "$PATCHES/series" 2>/dev/null)
  tmp=$(mktemp -d "$dir.part.XXXXXX") && rmdir "$tmp" || return 1
  cp -r "$BUNDLE_SITE" "$tmp"
  if ((BUNDLE_PATCHES == 0)); then
    for ((i=0; i<${#series[@]}; i++)); do
      _wanted "$variant" "${series[$i]}" || continue
      (cd "$tmp" && git apply --include='vllm/*' "$PATCHES/${series[$i]}") \
        || { echo "apply failed: ${series[$i]}"; rm -rf "$tmp"; return 1; }
    done
  else
    for ((i=${#series[@]}-1; i>=0; i--)); do
      _wanted "$variant" "${series[$i]}" && continue
      (cd "$tmp" && git apply -R --include='vllm/*' "$PATCHES/${series[$i]}") \
        || { echo "reverse-apply failed: ${series[$i]}"; rm -rf "$tmp"; return 1; }
    done
  fi
  mv -T "$tmp" "$dir" 2>/dev/null || rm -rf "$tmp"
  echo "[site] $variant: $dir"
}
# the old name, for scripts that make only upstream sites
make_upstream_site() { make_site "$@"; }
# Each variant compiles into its own vLLM cache (VLLM_CACHE_ROOT): the key of
# vLLM's torch.compile cache covers the configuration and the traced source,
# not every file a patch changes, so one variant could load the graph another
# compiled (seen on v0.33.0: the fork loaded upstream's EAGLE-3 backbone,
# compiled for other aux layers, and failed with upstream's error).
variant_cache() { echo "${HS_VLLM_CACHE:-${HS_SITE_ROOT:-/tmp}/vllm-cache}/${1//+/-with-}"; }
# The environment a variant's process runs in (for env; paths without
# blanks): its cache, and its site on PYTHONPATH (after the prefix $2, if
# given). Every GPU script starts a variant's process this way.
variant_env() {
  echo "VLLM_CACHE_ROOT=$(variant_cache "$1") PYTHONPATH=${2:+$2:}$(site_pythonpath "$1")"
}
# in_variant VARIANT CMD...: run CMD in the variant's environment
# (HS_EXTRA_PATH, if set, goes first on its PYTHONPATH)
in_variant() {
  local v=$1
  shift
  # shellcheck disable=SC2046
  env $(variant_env "$v" "${HS_EXTRA_PATH:-}") "$@"
}
# FlashInfer, where the bundle carries it, is importable only for the
# processes that test it: with it every engine autotunes and JIT-compiles
# at start (hsfork/flashinfer_toggle.sh says why). `flashinfer_for` moves it
# out of the shared dependency folder (HS_FLASHINFER=1: leaves it there for
# every process); a slice named flashinfer* then gets that folder first on
# its own PYTHONPATH (`slice_path`), so that it runs beside the others in
# one call instead of turning FlashInfer on for all of them.
FLASHINFER_DIR=$HS_HOME/flashinfer-off
flashinfer_for() {
  local mode=off
  [[ ${HS_FLASHINFER:-0} == 1 ]] && mode=on
  [ -d "$HS_HOME/deps" ] && bash "$R/hsfork/flashinfer_toggle.sh" "$mode" "$HS_HOME/deps"
  return 0
}
# slice_path SLICE: the PYTHONPATH prefix of a slice's processes
slice_path() {
  [[ $1 == flashinfer* && -d $FLASHINFER_DIR/flashinfer ]] && echo "$FLASHINFER_DIR"
  return 0
}
# prepare_variants "VARIANTS" MEM: every variant's site made; MEM is the
# default share of GPU memory per process (HSFORK_GPU_MEM overrides it)
prepare_variants() {
  local v
  for v in $1; do make_site "$v" || return 1; done
  export HSFORK_GPU_MEM=${HSFORK_GPU_MEM:-$2} HSFORK_KV_BYTES=${HSFORK_KV_BYTES:-2e9}
}
site_pythonpath() {
  local site
  site=$(_site_dir "$1")
  echo "$R:${PYTHONPATH//$BUNDLE_SITE/$site}"
}
