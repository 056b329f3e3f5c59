# shellcheck shell=bash
# Background jobs on a lent GPU host that outlive the call that starts them.
#
#   source hsfork/gpu_bg.sh
#   bg_start NAME CMD...          # CMD in a new session (setsid); its output
#                                 # folder $HS_BG/NAME is $BG_OUT in its env
#   bg_status                     # every job: RUNNING or done, its log's tail
#   bg_wait UNTIL NAME...         # wait until those jobs end, or until the
#                                 # calling shell's $SECONDS reaches UNTIL
#   bg_pack DEST NAME...          # DEST/bg-NAME.tgz of each ended job
#
# The device tool ends what a call leaves running when the call returns,
# except a process that started a session of its own. So a job started
# here runs on while the next calls stage a bundle or wait in short calls,
# and a call is no longer bound to one job's length. It ends with the lease:
# 30 s without a call gives the machine back (docs/gpu-host.md). Why not a
# tool: nohup alone keeps the process group the tool ends, and systemd or a
# queue (task-spooler, pueue) is not on the host; this is the four
# functions a session needs, no more.
HS_BG=${HS_BG:-/tmp/bg}

bg_start() {
  local name=$1
  shift
  mkdir -p "$HS_BG/$name"
  BG_OUT="$HS_BG/$name" setsid bash -c "$*" > "$HS_BG/$name.log" 2>&1 < /dev/null &
  echo $! > "$HS_BG/$name.pid"
  echo "[bg] $name started, pid $!"
}

_bg_alive() { kill -0 "$(cat "$HS_BG/$1.pid" 2>/dev/null)" 2>/dev/null; }

bg_status() {
  local f name state
  for f in "$HS_BG"/*.pid; do
    [ -f "$f" ] || continue
    name=$(basename "$f" .pid)
    if _bg_alive "$name"; then state=RUNNING; else state=done; fi
    echo "[bg] $name $state: $(tail -c 300 "$HS_BG/$name.log" | tr '\n' '|')"
  done
}

bg_wait() {
  local until=$1 name
  shift
  for name in "$@"; do
    while _bg_alive "$name" && [ "$SECONDS" -lt "$until" ]; do sleep 2; done
  done
  bg_status
}

bg_pack() {
  local dest=$1 name
  shift
  mkdir -p "$dest"
  for name in "$@"; do
    if _bg_alive "$name"; then
      echo "[bg] $name still running: not packed"
      continue
    fi
    tar czf "$dest/bg-$name.tgz" -C "$HS_BG" "$name" "$name.log" &&
      echo "[bg] packed $name"
  done
}
