#!/usr/bin/env bash
# Start the fleet on one Linux box against its own kernel NFS server, every replica on a
# simulated host of its own (a network namespace with its own NFS mount). Run as root.
#
#   deploy/attached-local/up.sh
#
# Safe to run again: whatever already exists or runs is left alone, whatever is missing is made
# or started (so it is also the repair after a crash). Settings are environment variables, see
# README.md; they are recorded in ATTACHED_ROOT/config.env for fault.sh and down.sh.
set -euo pipefail
# shellcheck source=deploy/attached-local/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

load_config
require_root
require_commands ip nsenter unshare setpriv mountpoint socat paste install
require_fleet_bin

# -- prerequisites that are not just commands -----------------------------------------------

kernel_has() {
  grep -qw "$1" /proc/filesystems
}

check_nfs() {
  require_commands exportfs mount.nfs
  if ! kernel_has nfsd; then
    modprobe nfsd 2>/dev/null || true
  fi
  kernel_has nfsd ||
    die "this kernel has no NFS server: 'nfsd' is not in /proc/filesystems and 'modprobe nfsd' did not add it (a container or a minimal VM kernel often lacks it; ATTACHED_STORAGE=bind rehearses everything but the storage)"
  if ! kernel_has nfs4; then
    modprobe nfsv4 2>/dev/null || true
  fi
  kernel_has nfs4 || die "this kernel has no NFSv4 client: 'modprobe nfsv4' did not add 'nfs4' to /proc/filesystems"
  if [ ! -r /proc/fs/nfsd/threads ] || [ "$(cat /proc/fs/nfsd/threads)" -eq 0 ]; then
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
      note "starting the NFS server (systemctl start nfs-server)"
      systemctl start nfs-server
    fi
  fi
  if [ ! -r /proc/fs/nfsd/threads ] || [ "$(cat /proc/fs/nfsd/threads)" -eq 0 ]; then
    die "the NFS server is not running and could not be started: start it (systemctl start nfs-server, or mount -t nfsd nfsd /proc/fs/nfsd && rpc.nfsd 8) and run this again"
  fi
  check_lease
}

# The lease decides how long a dead or partitioned owner keeps its sessions. The kernel accepts
# a new value only while nfsd is stopped, so changing it means a restart of the server.
check_lease() {
  local want=${ATTACHED_LEASE_S:-} have
  have=$(cat /proc/fs/nfsd/nfsv4leasetime)
  [ -n "$want" ] && [ "$want" != "$have" ] || return 0
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    mkdir -p /etc/nfs.conf.d
    printf '[nfsd]\nlease-time=%s\ngrace-time=%s\n' "$want" "$want" \
      >/etc/nfs.conf.d/fleet-attached.conf
    note "restarting the NFS server for a ${want}s lease (was ${have}s)"
    systemctl restart nfs-server
    have=$(cat /proc/fs/nfsd/nfsv4leasetime)
    [ "$have" = "$want" ] || die "asked for a ${want}s lease, the server runs ${have}s"
  else
    die "ATTACHED_LEASE_S=$want but the server's lease is ${have}s: stop nfsd, write $want to /proc/fs/nfsd/nfsv4leasetime and nfsv4gracetime, start it again"
  fi
}

ensure_user() {
  if id -u "$FLEET_USER" >/dev/null 2>&1; then
    return 0
  fi
  [ "$FLEET_USER" = fleetsim ] ||
    die "user '$FLEET_USER' (ATTACHED_USER) does not exist; create it or leave ATTACHED_USER unset"
  useradd --system --no-create-home --home-dir "$ATTACHED_ROOT/home" \
    --shell /usr/sbin/nologin fleetsim
  note "created system user fleetsim (the fleet's processes run as it)"
}

ensure_dirs() {
  local owner=("-o" "$FLEET_USER" "-g" "$(id -gn "$FLEET_USER")") shard
  install -d -m 0755 "$ATTACHED_ROOT" "$ATTACHED_ROOT/mnt" "$RUN"
  touch "$ATTACHED_ROOT/.fleet-attached"
  install -d "${owner[@]}" -m 0750 "$EXPORT" "$ATTACHED_ROOT/home" "$ATTACHED_ROOT/sandboxes"
  install -d "${owner[@]}" -m 0700 "$ATTACHED_ROOT/keys"
  while read -r shard; do
    install -d "${owner[@]}" -m 0750 "$EXPORT/$shard"
  done < <(all_shards)
}

ensure_export() {
  local file=/etc/exports.d/fleet-attached.exports line
  line="$EXPORT $NET.0/24(rw,sync,no_subtree_check,all_squash,anonuid=$(id -u "$FLEET_USER"),anongid=$(id -g "$FLEET_USER"))"
  mkdir -p /etc/exports.d
  if [ ! -f "$file" ] || [ "$(cat "$file")" != "$line" ]; then
    echo "$line" >"$file"
  fi
  exportfs -ra
  grep -q "^$EXPORT" <<<"$(exportfs -v)" || die "exportfs does not list $EXPORT after exportfs -ra"
}

ensure_network() {
  local name slice index netns ip host_if peer
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  grep -qF " $HOST_IP/24 " <<<"$(ip -o addr show dev "$BRIDGE")" ||
    ip addr add "$HOST_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  while read -r name slice index; do
    netns=$(netns_of "$name")
    ip=$(replica_ip "$name")
    host_if="fa-$name-h"
    peer="fa-$name-n"
    [ -e "/run/netns/$netns" ] || ip netns add "$netns"
    ip link show "$host_if" >/dev/null 2>&1 ||
      ip link add "$host_if" type veth peer name "$peer" netns "$netns"
    ip link set "$host_if" master "$BRIDGE" up
    ip netns exec "$netns" ip link set lo up
    grep -qF " $ip/24 " <<<"$(ip -n "$netns" -o addr show dev "$peer")" ||
      ip -n "$netns" addr add "$ip/24" dev "$peer"
    ip -n "$netns" link set "$peer" up
  done < <(replicas)
}

# Each simulated host needs its own NFSv4 client identity, or the server would take every
# namespace for one client and their locks would not conflict. Two things make it unique: the
# per-namespace identifier (newer kernels) and a host name of its own in a UTS namespace at
# mount time (the client id string carries it on every kernel).
mount_replica() {
  local name=$1 netns mnt
  netns=$(netns_of "$name")
  mnt=$(mount_of "$name")
  install -d -m 0755 "$mnt"
  if mountpoint -q "$mnt"; then
    return 0
  fi
  if [ "$STORAGE" = bind ]; then
    mount --bind "$EXPORT" "$mnt"
    return 0
  fi
  # shellcheck disable=SC2016 # expanded by the inner shell
  ip netns exec "$netns" sh -c '
    f=/sys/fs/nfs/net/nfs_client/identifier
    if [ -w "$f" ] && { [ ! -s "$f" ] || [ "$(cat "$f")" = "(null)" ]; }; then
      cat /proc/sys/kernel/random/uuid >"$f"
    fi'
  # shellcheck disable=SC2016 # expanded by the inner shell
  nsenter --net="/run/netns/$netns" unshare --uts sh -c \
    'hostname "$1" && exec mount -t nfs -o "$2" "$3" "$4"' \
    sh "fleet-attached-$name" "$NFS_OPTS" "$HOST_IP:$EXPORT" "$mnt" ||
    die "mounting $HOST_IP:$EXPORT on $mnt from namespace $netns failed (see dmesg; is $NET.0/24 exported?)"
}

ensure_keys() {
  [ -s "$KEYS/grant-keys.txt" ] && return 0
  HOME="$ATTACHED_ROOT/home" setpriv "--reuid=$FLEET_USER" "--regid=$(id -g "$FLEET_USER")" --clear-groups \
    "$FLEET_BIN/fleet-sim" keys --dir "$KEYS" >/dev/null
}

render_edge_toml() {
  local spec slice name s index
  echo "[edge]"
  echo "retry_budget_s = 120"
  for spec in $SLICES; do
    slice=${spec%%:*}
    printf '\n[[slice]]\nname = "%s"\nreplicas = [\n' "$slice"
    while read -r name s index; do
      if [ "$s" = "$slice" ]; then
        echo "  { name = \"$name\", url = \"$(replica_url "$name")\" },"
      fi
    done < <(replicas)
    echo "]"
  done
}

start_services() {
  local spec slices=() name slice index
  for spec in $SLICES; do
    slices+=(--slice "$spec")
  done
  is_running sandbox || start_process sandbox "" "$PY" -m fleet_sim.sandbox \
    --listen "$HOST_IP:7700" --root "$ATTACHED_ROOT/sandboxes" --secret-file "$SANDBOX_SECRET"
  wait_http "$SANDBOX_URL/_sim/health" 30 "the sandbox simulator (log: $RUN/sandbox.log)"
  is_running control-plane || start_process control-plane "" "$PY" -m fleet_sim.control_plane \
    --listen "$HOST_IP:7800" --keys "$KEYS" --sandbox-url "$SANDBOX_URL" \
    --sandbox-secret "$SANDBOX_SECRET" --edge-url "$EDGE_URL" \
    --journal "$ATTACHED_ROOT/home/lifecycle.jsonl" "${slices[@]}"
  wait_http "$CONTROL_URL/healthz" 30 "the control plane (log: $RUN/control-plane.log)"
  while read -r name slice index; do
    is_running "$name" || start_replica "$name"
    is_running "relay-$name" || start_relay "$name"
  done < <(replicas)
  while read -r name slice index; do
    wait_http "$(replica_url "$name")/readyz" 60 "replica $name (log: $RUN/$name.log)"
  done < <(replicas)
  local config="$ATTACHED_ROOT/edge.toml" rendered
  rendered=$(render_edge_toml)
  if [ ! -f "$config" ] || [ "$(cat "$config")" != "$rendered" ]; then
    echo "$rendered" >"$config"
    if is_running edge; then
      kill -HUP "$(pid_of edge)"
    fi
  fi
  is_running edge || start_process edge "" "$FLEET_BIN/fleet-edge" serve --config "$config" \
    --listen "127.0.0.1:$EDGE_PORT" --metrics-listen 127.0.0.1:9180
  wait_http "$EDGE_URL/readyz" 30 "the edge (log: $RUN/edge.log)"
}

if [ "$STORAGE" = nfs ]; then
  check_nfs
fi
ensure_user
ensure_dirs
save_config
if [ "$STORAGE" = nfs ]; then
  ensure_export
fi
ensure_network
while read -r name _slice _index; do
  mount_replica "$name"
done < <(replicas)
ensure_keys
start_services
write_state

cat <<EOF

The attached fleet is up ($(replicas | wc -l) replicas, storage: $STORAGE$([ "$STORAGE" = nfs ] && echo ", lease $(lease_s)s")).
  edge           $EDGE_URL
  control plane  $CONTROL_URL
  state          $STATE
  logs           $RUN/
A session: curl -d '{"tenant":"demo"}' $CONTROL_URL/v1/sessions
The scenarios: ATTACHED_ROOT=$ATTACHED_ROOT fleet-sim matrix --substrate attached \\
                 --state $STATE --fault-cmd deploy/attached-local/fault.sh
Faults by hand: deploy/attached-local/fault.sh status | kill r1 | partition r1 | heal r1 ...
EOF
