#!/usr/bin/env bash
# Source from a GPU-host script: makes /tmp/upstream-site (upstream v0.26.0:
# the bundle's fork site with the patch series reversed) if it is missing,
# and defines `site_pythonpath VARIANT` (fork | upstream) that prints the
# PYTHONPATH for that variant, the repo first.
# Needs the bundle installed at /tmp/hybridspec and R = the repo root.
# shellcheck disable=SC1091
source /tmp/hybridspec/env.sh
make_upstream_site() {
  [[ -d /tmp/upstream-site ]] && return 0
  cp -r /tmp/hybridspec/site /tmp/upstream-site
  local series i
  mapfile -t series < "$R/patches/series"
  for ((i=${#series[@]}-1; i>=0; i--)); do
    (cd /tmp/upstream-site && git apply -R --include='vllm/*' "$R/patches/${series[$i]}") \
      || { echo "reverse-apply failed: ${series[$i]}"; return 1; }
  done
}
site_pythonpath() {
  local site=/tmp/hybridspec/site
  [[ $1 == upstream ]] && site=/tmp/upstream-site
  echo "$R:${PYTHONPATH//\/tmp\/hybridspec\/site/$site}"
}
