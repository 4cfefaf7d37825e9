#!/usr/bin/env bash
# Faults for the attached fleet up.sh started: `fault.sh VERB [REPLICA]`. Run as root.
#
#   kill R       SIGKILL the replica. On one box the kernel still closes its files and returns
#                its locks to the server, so takeover is quick; `lose` is the host-loss case
#   lose R       partition R, then SIGKILL it: nothing can give its locks back, and a survivor
#                waits for the server's lease to lapse (heal R afterwards)
#   term R       SIGTERM (a drain) and wait for the exit, up to the drain grace plus 15 s
#   pause R      SIGSTOP: the process stops, its kernel keeps renewing the lease
#   resume R     SIGCONT
#                (drain, freeze and thaw are the names `fleet-sim fault` uses for term, pause
#                and resume, and are taken here too)
#   restart R    start R again in its namespace, on its mount, and wait until it is ready
#   partition R  drop NFS traffic (TCP 2049) inside R's namespace; R's HTTP still answers
#   heal R       remove that rule
#   hang R       the same rule, meant to be lifted before the lease lapses: a mount that hangs
#   unhang R     and answers again, without the server revoking anything
#   metrics R    print R's Prometheus scrape (read inside its namespace)
#   status       every process, mount and partition
#
# `fleet-sim matrix --substrate attached --fault-cmd deploy/attached-local/fault.sh` calls it as
# `fault.sh VERB REPLICA`; it finds the fleet through ATTACHED_ROOT (default /srv/fleet-attached).
# Exit status: 0 done, 1 failed, 2 usage, 3 not applicable to this fleet's storage.
set -euo pipefail
# shellcheck source=deploy/attached-local/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  sed -n '2,19p' "$0" >&2
  exit 2
}

[ $# -ge 1 ] || usage
VERB=$1
TARGET=${2:-}

[ -f "$CONFIG_FILE" ] || die "no attached fleet under $ATTACHED_ROOT (run up.sh, or set ATTACHED_ROOT)"
load_config
require_root

need_replica() {
  [ -n "$TARGET" ] || usage
  grep -qx -- "$TARGET" <<<"$(replicas | cut -d' ' -f1)" ||
    die "no replica named '$TARGET' (this fleet has: $(replicas | cut -d' ' -f1 | paste -sd' ' -))"
}

need_running() {
  is_running "$TARGET" || die "$TARGET is not running"
}

need_nfs() {
  if [ "$STORAGE" != nfs ]; then
    echo "attached-local: $VERB needs NFS storage; this fleet runs on '$STORAGE'" >&2
    exit 3
  fi
}

do_kill() {
  need_running
  stop_process "$TARGET" KILL 10 ||
    note "$TARGET is still exiting 10s after SIGKILL (its exit is blocked on storage)"
  write_state
}

do_term() {
  local grace=$((DRAIN_GRACE_S + 15))
  need_running
  stop_process "$TARGET" TERM "$grace" || die "$TARGET is still running ${grace}s after SIGTERM"
  write_state
}

do_restart() {
  if is_running "$TARGET"; then
    die "$TARGET is still running; kill or term it first"
  fi
  start_replica "$TARGET"
  wait_http "$(replica_url "$TARGET")/readyz" 120 "replica $TARGET (log: $RUN/$TARGET.log)"
  write_state
}

do_status() {
  local name slice _index netns mnt what detail
  printf '%-14s %-8s %-8s %s\n' PROCESS PID STATE DETAIL
  for name in sandbox control-plane edge; do
    what=stopped
    is_running "$name" && what=running
    printf '%-14s %-8s %-8s %s\n' "$name" "$(pid_of "$name" || echo -)" "$what" ""
  done
  while read -r name slice _index; do
    netns=$(netns_of "$name")
    mnt=$(mount_of "$name")
    what=stopped
    if is_running "$name"; then
      what=running
      if grep -q '^State:.*stopped' "/proc/$(pid_of "$name")/status" 2>/dev/null; then
        what=paused
      fi
    fi
    detail="slice $slice, $(replica_url "$name"), ns $netns"
    mountpoint -q "$mnt" || detail+=", NOT MOUNTED"
    if [ -e "/run/netns/$netns" ] && is_partitioned "$netns"; then
      detail+=", PARTITIONED"
    fi
    printf '%-14s %-8s %-8s %s\n' "$name" "$(pid_of "$name" || echo -)" "$what" "$detail"
  done < <(replicas)
}

case "$VERB" in
  kill) need_replica; do_kill ;;
  lose)
    need_replica
    need_nfs
    need_running
    partition_on "$(netns_of "$TARGET")"
    do_kill
    ;;
  term | drain) need_replica; do_term ;;
  pause | freeze) need_replica; need_running; kill -STOP "$(pid_of "$TARGET")" ;;
  resume | thaw) need_replica; need_running; kill -CONT "$(pid_of "$TARGET")" ;;
  restart) need_replica; do_restart ;;
  partition | hang) need_replica; need_nfs; partition_on "$(netns_of "$TARGET")" ;;
  heal | unhang) need_replica; need_nfs; partition_off "$(netns_of "$TARGET")" ;;
  metrics)
    need_replica
    ip netns exec "$(netns_of "$TARGET")" "$PY" -c \
      "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:9102/metrics', timeout=5).read().decode())"
    ;;
  status) do_status ;;
  -h | --help | help) usage ;;
  *) echo "attached-local: unknown fault '$VERB'" >&2; usage ;;
esac
