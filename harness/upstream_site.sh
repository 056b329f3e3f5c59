#!/usr/bin/env bash
# Source from a GPU-host script: makes unpatched upstream sites from the
# bundle's fork site by reversing the patch series, and defines
# `site_pythonpath VARIANT` that prints the PYTHONPATH for a variant, the
# repo first. Variants: fork; upstream (the whole series reversed, at
# /tmp/upstream-site); upstream+NNNN[+MMMM...] (every patch reversed except
# the numbered ones, e.g. upstream+0015: upstream with only patch 0015).
# Needs the bundle installed at /tmp/hybridspec and R = the repo root.
# shellcheck disable=SC1091
source /tmp/hybridspec/env.sh
# the series of the bundle's line (env.sh sets HSFORK_BASE)
PATCHES=${PATCHES:-$(cd "$R" && python3 -c 'from hsfork.common import patches_dir; print(patches_dir())')}
_site_dir() {
  if [[ $1 == upstream ]]; then echo /tmp/upstream-site; else echo "/tmp/site-$1"; fi
}
make_upstream_site() {
  local variant=${1:-upstream} dir series i keep
  dir=$(_site_dir "$variant")
  [[ -d $dir ]] && return 0
  cp -r /tmp/hybridspec/site "$dir"
  mapfile -t series < "$PATCHES/series"
  for ((i=${#series[@]}-1; i>=0; i--)); do
    keep=0
    for n in ${variant//+/ }; do [[ ${series[$i]} == "$n"-* ]] && keep=1; done
    ((keep)) && continue
    (cd "$dir" && git apply -R --include='vllm/*' "$PATCHES/${series[$i]}") \
      || { echo "reverse-apply failed: ${series[$i]}"; return 1; }
  done
}
site_pythonpath() {
  local site=/tmp/hybridspec/site
  [[ $1 != fork ]] && site=$(_site_dir "$1")
  echo "$R:${PYTHONPATH//\/tmp\/hybridspec\/site/$site}"
}
