# Pack a GPU call's results into one archive under $OUT, and keep a partial
# archive up to date while the call runs (sourced by harness/gpu_matrix.sh
# and harness/gpu_fuzz.sh).
#
# A lent GPU host returns at most 8 files of $OUT, and a call that runs past
# its limit is killed before a final `tar` can run: its reports, loose in
# $OUT, then mostly do not come back. So, besides the final archive:
#
#   pack_start NAME DIR...   # every PACK_EVERY seconds (30), DIR... under
#                            # $OUT packed into $OUT/NAME-partial.tgz
#   pack_final NAME DIR...   # stop that, pack $OUT/NAME-HHMMSS.tgz, remove
#                            # DIR... and the partial archive
#
# A killed call leaves the partial archive of at most PACK_EVERY seconds
# before the kill. Each archive is written beside and then renamed into
# place, so that a kill mid-write leaves the previous one whole.
# Why by hand: nothing on the host (tar, coreutils) keeps an archive of a
# growing folder; this is a loop around tar.

_pack() {  # ARCHIVE DIR...: one archive of the DIRs that exist, written atomically
  local archive=$1 d dirs=()
  shift
  for d in "$@"; do [ -e "$OUT/$d" ] && dirs+=("$d"); done
  ((${#dirs[@]})) || return 0
  tar -czf "$archive.tmp" -C "$OUT" "${dirs[@]}" 2>/dev/null &&
    mv -f "$archive.tmp" "$archive"
}

pack_start() {
  local name=$1
  shift
  (
    trap 'exit 0' TERM
    while sleep "${PACK_EVERY:-30}"; do
      _pack "$OUT/$name-partial.tgz" "$@"
    done
  ) &
  PACK_PID=$!
}

pack_final() {
  local name=$1 d
  shift
  if [ -n "${PACK_PID:-}" ]; then
    kill "$PACK_PID" 2>/dev/null
    wait "$PACK_PID" 2>/dev/null
    PACK_PID=
  fi
  _pack "$OUT/$name-$(date +%H%M%S).tgz" "$@" || return 1
  for d in "$@"; do rm -rf "${OUT:?}/$d"; done
  rm -f "$OUT/$name-partial.tgz" "$OUT/$name-partial.tgz.tmp"
}
