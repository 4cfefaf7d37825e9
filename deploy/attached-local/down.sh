#!/usr/bin/env bash
# Stop the attached fleet and take down what up.sh made. Run as root.
#
#   deploy/attached-local/down.sh [--purge]
#
# Partitions are healed and paused replicas resumed first (neither could exit otherwise), replicas
# drain (SIGTERM, up to the drain grace), then the edge, control plane, sandbox simulator and
# metrics relays stop; mounts, namespaces, the bridge and the export go. The data (export/,
# keys/, logs) stays unless --purge, which removes ATTACHED_ROOT entirely. Safe to run again.
set -euo pipefail
# shellcheck source=deploy/attached-local/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PURGE=0
case "${1:-}" in
  --purge) PURGE=1 ;;
  '') ;;
  *) die "usage: down.sh [--purge]" ;;
esac

load_config
require_root

stop_or_kill() {
  local name=$1 grace=$2
  stop_process "$name" TERM "$grace" && return 0
  note "$name did not stop within ${grace}s of SIGTERM; sending SIGKILL"
  stop_process "$name" KILL 10 || note "$name is still exiting (blocked on storage?)"
}

names=()
while read -r name _slice _index; do
  names+=("$name")
done < <(replicas)

for name in "${names[@]}"; do
  netns=$(netns_of "$name")
  if [ -e "/run/netns/$netns" ]; then
    partition_off "$netns"
  fi
done
# All replicas drain at once: each gets the full grace, and the slice empties in one grace.
# A paused one is resumed first, or it would sit on the SIGTERM until the SIGKILL.
for name in "${names[@]}"; do
  if is_running "$name"; then
    kill -CONT "$(pid_of "$name")" 2>/dev/null || true
    kill -TERM "$(pid_of "$name")" 2>/dev/null || true
  fi
done
for name in "${names[@]}"; do
  stop_or_kill "$name" $((DRAIN_GRACE_S + 15))
  stop_or_kill "relay-$name" 5
done
stop_or_kill edge 15
stop_or_kill control-plane 10
stop_or_kill sandbox 10

for name in "${names[@]}"; do
  mnt=$(mount_of "$name")
  if mountpoint -q "$mnt" 2>/dev/null; then
    umount "$mnt" 2>/dev/null || umount -f -l "$mnt" || note "could not unmount $mnt"
  fi
  # Deleting either end of a veth pair deletes both, and a namespace's deletion takes its end
  # with it asynchronously: the host end goes first, tolerating that it is already gone.
  ip link del "fa-$name-h" 2>/dev/null || true
  netns=$(netns_of "$name")
  if [ -e "/run/netns/$netns" ]; then
    ip netns del "$netns"
  fi
done
if ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link del "$BRIDGE"
fi

if [ -f /etc/exports.d/fleet-attached.exports ]; then
  rm -f /etc/exports.d/fleet-attached.exports
  if command -v exportfs >/dev/null 2>&1; then
    exportfs -ra || note "exportfs -ra failed; check /etc/exports"
  fi
fi
rm -f "$STATE" "$CONFIG_FILE"

if [ "$PURGE" = 1 ]; then
  # Only a directory up.sh made (it leaves a marker) is ever removed wholesale.
  if [ -f "$ATTACHED_ROOT/.fleet-attached" ]; then
    rm -rf --one-file-system "$ATTACHED_ROOT"
    echo "stopped and removed $ATTACHED_ROOT"
  else
    note "$ATTACHED_ROOT has no .fleet-attached marker; not removing it"
  fi
else
  echo "stopped; data kept in $ATTACHED_ROOT (down.sh --purge removes it)"
fi
