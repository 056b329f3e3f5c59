#!/usr/bin/env bash
# Switch a GPU host from the installed line to another bundle installed
# beside it, so that one lease can run both lines one after the other.
#
#   HS_STAGING=/tmp/hs-staging-33 HS_TARGET=/tmp/hybridspec-33 \
#     bash hsfork/gpu_stage.sh build/v0.33.0/bundle/upload-N ...   # while
#                                         # the first line's jobs run
#   bash hsfork/gpu_switch.sh /tmp/hybridspec-33                   # after
#
# The GPU scripts read the installed bundle at $HS_TARGET (/tmp/hybridspec)
# and make the upstream and partial sites from it under $HS_SITE_ROOT
# (/tmp: upstream-site, fork-site, site-*). This moves that install and
# those sites into $HS_PARKED/line-v<version> (/tmp/line-v<version>), where
# <version> is the install's manifest version, and links $HS_TARGET to
# NEW_TARGET; env.sh there names the folder it was installed into, so it
# stays valid. A second switch, from a link, removes the link instead; a
# switch back to a parked install brings its sites back too.
# To run both lines at once instead, start the second line's scripts with
# HS_HOME=NEW_TARGET (harness/upstream_site.sh); no switch is needed then.
# Exit 4, moving nothing, while a background job of hsfork/gpu_bg.sh runs:
# its next engine would import the other line. Why by hand: the paths are
# this project's own; a switch is the five moves a session did by hand.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TARGET=${HS_TARGET:-/tmp/hybridspec}
ROOT=${HS_SITE_ROOT:-/tmp}
[ $# -eq 1 ] || { echo "usage: $0 NEW_TARGET" >&2; exit 2; }
NEW=$(cd "$1" && pwd)
[ -f "$NEW/manifest.json" ] && [ -f "$NEW/env.sh" ] ||
  { echo "error: $NEW holds no installed bundle (manifest.json, env.sh)" >&2; exit 2; }
# shellcheck disable=SC1091
source "$HERE/gpu_bg.sh"
running=()
for f in "$HS_BG"/*.pid; do
  [ -f "$f" ] || continue
  name=$(basename "$f" .pid)
  _bg_alive "$name" && running+=("$name")
done
if ((${#running[@]})); then
  echo "[switch] refused: background jobs still running: ${running[*]}" >&2
  exit 4
fi
version() {
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"].split("+")[0])' "$1"
}
if [ -e "$TARGET" ] || [ -L "$TARGET" ]; then
  old=$(version "$TARGET/manifest.json")
  park=${HS_PARKED:-/tmp}/line-v$old
  mkdir -p "$park"
  if [ -L "$TARGET" ]; then
    rm "$TARGET"
  else
    mv "$TARGET" "$park/"
  fi
  for d in "$ROOT/upstream-site" "$ROOT/fork-site" "$ROOT"/site-*; do
    [ -e "$d" ] && mv "$d" "$park/"
  done
  echo "[switch] v$old parked in $park"
fi
# back to a parked line: its sites come back with it
src=$(dirname "$NEW")
case $src in
*/line-v*)
  for d in "$src/upstream-site" "$src/fork-site" "$src"/site-*; do
    [ -e "$d" ] && mv "$d" "$ROOT/"
  done ;;
esac
ln -s "$NEW" "$TARGET"
echo "[switch] $TARGET -> $NEW (v$(version "$NEW/manifest.json"))"
