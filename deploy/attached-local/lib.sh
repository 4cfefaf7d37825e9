# shellcheck shell=bash
# shellcheck disable=SC2034 # settings defined here are used by the scripts that source this
# Shared by up.sh, down.sh and fault.sh: settings, checks, and starting one fleet process.
#
# Layout on the box (ATTACHED_ROOT, default /srv/fleet-attached):
#   export/<shard>/        the NFS export: the shards' one true copy, read by graders
#   mnt/<replica>/         that replica host's own NFS mount of export/
#   keys/fleet/            the keyset (local disk, never on the export)
#   keys/sandbox.key       the sandbox simulator's secret
#   home/                  the fleet user's home: the lifecycle journal (lifecycle.jsonl)
#   run/<name>.pid|.log    every process this harness started
#   config.env             the settings up.sh ran with (fault.sh and down.sh read them back)
#   state.json             what `fleet-sim matrix --substrate attached --state` reads
#
# Each replica host is a network namespace fa-<replica> on a bridge fa-br0: its NFS traffic, and
# so its NFSv4 client and lease, are its own, and a firewall rule inside it cuts it off alone.

ATTACHED_ROOT=${ATTACHED_ROOT:-/srv/fleet-attached}
CONFIG_FILE="$ATTACHED_ROOT/config.env"
MARKER="$ATTACHED_ROOT/.fleet-attached"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

die() {
  echo "attached-local: $*" >&2
  exit 1
}

note() {
  echo "attached-local: $*" >&2
}

# Settings: environment first, then what a previous up.sh recorded, then defaults. up.sh calls
# this before recording; fault.sh and down.sh see exactly what up.sh ran with.
load_config() {
  if [ -f "$CONFIG_FILE" ]; then
    # shellcheck source=/dev/null
    . "$CONFIG_FILE"
  fi
  STORAGE=${ATTACHED_STORAGE:-${STORAGE:-nfs}}
  NET=${ATTACHED_NET:-${NET:-10.231.0}}
  SLICES=${ATTACHED_SLICES:-${SLICES:-"a07:s1,s2 a08:s1,s2"}}
  PER_SLICE=${ATTACHED_REPLICAS_PER_SLICE:-${PER_SLICE:-3}}
  FLEET_USER=${ATTACHED_USER:-${FLEET_USER:-fleetsim}}
  FLEET_BIN=${ATTACHED_FLEET_BIN:-${FLEET_BIN:-$REPO/.venv/bin}}
  MODEL=${ATTACHED_MODEL:-${MODEL:-mock}}
  DRAIN_GRACE_S=${ATTACHED_DRAIN_GRACE_S:-${DRAIN_GRACE_S:-30}}
  IDLE_TIMEOUT_S=${ATTACHED_IDLE_TIMEOUT_S:-${IDLE_TIMEOUT_S:-60}}
  EDGE_PORT=${ATTACHED_EDGE_PORT:-${EDGE_PORT:-8080}}
  NFS_OPTS=${ATTACHED_NFS_OPTS:-${NFS_OPTS:-nfsvers=4.2,proto=tcp,hard,timeo=600,retrans=2,lookupcache=positive,actimeo=1}}
  STATE=${ATTACHED_STATE:-${STATE:-$ATTACHED_ROOT/state.json}}
  case "$STORAGE" in
    nfs | bind) ;;
    *) die "ATTACHED_STORAGE must be nfs or bind, got '$STORAGE'" ;;
  esac
  case "$PER_SLICE" in
    '' | *[!0-9]* | 0) die "ATTACHED_REPLICAS_PER_SLICE must be a positive number" ;;
  esac
  [[ "$NET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "ATTACHED_NET must be three octets, e.g. 10.231.0"
  PY="$FLEET_BIN/python"
  HOST_IP="$NET.1"
  RUN="$ATTACHED_ROOT/run"
  KEYS="$ATTACHED_ROOT/keys/fleet"
  SANDBOX_SECRET="$ATTACHED_ROOT/keys/sandbox.key"
  EXPORT="$ATTACHED_ROOT/export"
  BRIDGE=fa-br0
  SANDBOX_URL="http://$HOST_IP:7700"
  CONTROL_URL="http://$HOST_IP:7800"
  EDGE_URL="http://127.0.0.1:$EDGE_PORT"
}

save_config() {
  local name
  {
    echo "# written by deploy/attached-local/up.sh; read back by fault.sh and down.sh"
    for name in STORAGE NET SLICES PER_SLICE FLEET_USER FLEET_BIN MODEL DRAIN_GRACE_S \
      IDLE_TIMEOUT_S EDGE_PORT NFS_OPTS STATE; do
      printf '%s=%q\n' "$name" "${!name}"
    done
  } >"$CONFIG_FILE"
}

# Replicas are r1..rN across the slices in order, as `fleet-sim up` names them; each line is
# "NAME SLICE INDEX".
replicas() {
  local spec n=0 i
  for spec in $SLICES; do
    for ((i = 1; i <= PER_SLICE; i++)); do
      n=$((n + 1))
      echo "r$n ${spec%%:*} $n"
    done
  done
}

replica_field() {
  local want=$1 field=$2 name slice index
  while read -r name slice index; do
    if [ "$name" = "$want" ]; then
      case "$field" in
        slice) echo "$slice" ;;
        index) echo "$index" ;;
      esac
      return 0
    fi
  done < <(replicas)
  die "no replica named '$want' (this fleet has: $(replicas | cut -d' ' -f1 | paste -sd' ' -))"
}

slice_shards() {
  local want=$1 spec shard
  for spec in $SLICES; do
    [ "${spec%%:*}" = "$want" ] || continue
    for shard in $(echo "${spec#*:}" | tr ',' ' '); do
      echo "$want-$shard"
    done
  done
}

all_shards() {
  local spec
  for spec in $SLICES; do
    slice_shards "${spec%%:*}"
  done
}

netns_of() { echo "fa-$1"; }
replica_ip() { echo "$NET.$((10 + $(replica_field "$1" index)))"; }
replica_url() { echo "http://$(replica_ip "$1"):9101"; }
relay_port() { echo "$((19100 + $(replica_field "$1" index)))"; }
mount_of() { echo "$ATTACHED_ROOT/mnt/$1"; }

require_root() {
  [ "$(id -u)" -eq 0 ] || die "run as root: it creates network namespaces, NFS mounts and exports"
}

require_commands() {
  local missing=() cmd
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
  done
  [ ${#missing[@]} -eq 0 ] ||
    die "missing commands: ${missing[*]} (Debian: iproute2 util-linux socat nfs-kernel-server nfs-common nftables)"
}

require_fleet_bin() {
  local tool
  for tool in python fleet-replica fleet-edge fleet-sim; do
    [ -x "$FLEET_BIN/$tool" ] ||
      die "no fleet install in $FLEET_BIN (no $tool): run scripts/bootstrap, or set ATTACHED_FLEET_BIN"
  done
}

# -- processes ------------------------------------------------------------------------------

pid_of() {
  local file="$RUN/$1.pid"
  [ -s "$file" ] && cat "$file"
}

# Running, and still the process we started (a recycled pid would not carry the marker).
is_running() {
  local name=$1 pid
  pid=$(pid_of "$name") || return 1
  [ -r "/proc/$pid/cmdline" ] || return 1
  # (grep reads a here-string: under pipefail an early grep -q exit would fail the pipe)
  grep -qF -- "$(marker_of "$name")" <<<"$(tr '\0' ' ' <"/proc/$pid/cmdline")"
}

# What identifies each process in its command line.
marker_of() {
  case "$1" in
    sandbox) echo "fleet_sim.sandbox" ;;
    control-plane) echo "fleet_sim.control_plane" ;;
    edge) echo "fleet-edge serve" ;;
    relay-*) echo "TCP-LISTEN:$(relay_port "${1#relay-}")" ;;
    *) echo "--name $1 " ;;
  esac
}

# start NAME NETNS CMD... : detached, as the fleet user (relays stay root: they only enter a
# namespace), stdout and stderr to run/NAME.log, pid to run/NAME.pid. nohup, ip netns exec and
# setpriv all exec, so the recorded pid is the fleet process itself.
start_process() {
  local name=$1 netns=$2
  shift 2
  local prefix=()
  if [ -n "$netns" ]; then
    prefix=(ip netns exec "$netns")
  fi
  if [[ "$name" != relay-* ]]; then
    prefix+=(setpriv "--reuid=$FLEET_USER" "--regid=$(id -g "$FLEET_USER")" --clear-groups)
  fi
  HOME="$ATTACHED_ROOT/home" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    nohup "${prefix[@]}" "$@" >"$RUN/$name.log" 2>&1 </dev/null &
  echo "$!" >"$RUN/$name.pid"
}

# Signal NAME and wait up to SECONDS for it to go; returns 1 if it is still there.
stop_process() {
  local name=$1 signal=$2 seconds=$3 pid waited=0
  is_running "$name" || return 0
  pid=$(pid_of "$name")
  kill "-$signal" "$pid" 2>/dev/null || true
  while is_running "$name"; do
    [ "$waited" -lt $((seconds * 10)) ] || return 1
    sleep 0.1
    waited=$((waited + 1))
  done
}

http_ok() {
  "$PY" - "$1" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError:
    sys.exit(1)
EOF
}

wait_http() {
  local url=$1 seconds=$2 what=$3 waited=0
  until http_ok "$url"; do
    [ "$waited" -lt "$seconds" ] || die "$what did not answer 200 on $url within ${seconds}s"
    sleep 1
    waited=$((waited + 1))
  done
}

start_replica() {
  local name=$1 slice args=() shard line
  slice=$(replica_field "$name" slice)
  while read -r shard; do
    args+=(--shard "$shard=$(mount_of "$name")/$shard")
  done < <(slice_shards "$slice")
  while read -r line; do
    [ -n "$line" ] && args+=(--grant-key "$line")
  done <"$KEYS/grant-keys.txt"
  start_process "$name" "$(netns_of "$name")" "$FLEET_BIN/fleet-replica" serve --service \
    --listen "$(replica_ip "$name"):9101" --name "$name" \
    --seal-key "$KEYS/seal.key" --notify-key "$KEYS/notify.key" \
    --notify-origin "$EDGE_URL" --lifecycle-url "$CONTROL_URL/v1/lifecycle" \
    --model "$MODEL" --drain-grace "$DRAIN_GRACE_S" --session-idle-timeout "$IDLE_TIMEOUT_S" \
    --metrics-listen 127.0.0.1:9102 "${args[@]}"
}

# The scrape is loopback-only inside the namespace; this relay puts it on the host's loopback.
start_relay() {
  local name=$1
  start_process "relay-$name" "" socat \
    "TCP-LISTEN:$(relay_port "$name"),bind=127.0.0.1,reuseaddr,fork" \
    "EXEC:ip netns exec $(netns_of "$name") socat STDIO TCP4\:127.0.0.1\:9102"
}

lease_s() {
  if [ "$STORAGE" = nfs ] && [ -r /proc/fs/nfsd/nfsv4leasetime ]; then
    cat /proc/fs/nfsd/nfsv4leasetime
  else
    echo null
  fi
}

# state.json in the shape `fleet-sim up --state` writes, plus what an attached run needs:
# the namespace of each replica, the export path of each shard (graders read the server's copy,
# never a replica's possibly partitioned mount), the storage and the lease.
write_state() {
  local rows=() name slice index shards
  while read -r name slice index; do
    shards=$(slice_shards "$slice" | paste -sd, -)
    rows+=("$name" "$slice" "$(replica_url "$name")" "$(relay_port "$name")"
      "$(pid_of "$name" || echo null)" "$shards" "$(mount_of "$name")" "$(netns_of "$name")")
  done < <(replicas)
  STATE_EDGE_PID=$(pid_of edge || echo null) \
    STATE_CP_PID=$(pid_of control-plane || echo null) \
    STATE_SB_PID=$(pid_of sandbox || echo null) \
    STATE_LEASE=$(lease_s) \
    STATE_ALL_SHARDS=$(all_shards | paste -sd, -) \
    STATE_STORAGE=$STORAGE STATE_NFS_OPTS=$NFS_OPTS STATE_EDGE_URL=$EDGE_URL \
    STATE_CONTROL_URL=$CONTROL_URL STATE_SANDBOX_URL=$SANDBOX_URL STATE_KEYS=$KEYS \
    STATE_ROOT=$ATTACHED_ROOT STATE_EXPORT=$EXPORT STATE_FAULT_CMD="$HERE/fault.sh" \
    "$PY" - "$STATE.tmp" "${rows[@]}" <<'EOF'
import json, os, sys
env = os.environ
def num(text):
    return None if text == "null" else int(text)
out, rows = sys.argv[1], sys.argv[2:]
replicas = []
for at in range(0, len(rows), 8):
    name, slice_name, url, relay, pid, shards, mount, netns = rows[at : at + 8]
    replicas.append({
        "name": name,
        "slice": slice_name,
        "url": url,
        "metrics_url": f"http://127.0.0.1:{relay}/metrics",
        "pid": num(pid),
        "shards": {s: os.path.join(mount, s) for s in shards.split(",")},
        "netns": netns,
        "mount": mount,
    })
root = env["STATE_ROOT"]
state = {
    "substrate": "attached-local",
    "storage": env["STATE_STORAGE"],
    "nfs_options": env["STATE_NFS_OPTS"] if env["STATE_STORAGE"] == "nfs" else None,
    "lease_s": num(env["STATE_LEASE"]),
    "edge_url": env["STATE_EDGE_URL"],
    "edge_pid": num(env["STATE_EDGE_PID"]),
    "edge_metrics_url": "http://127.0.0.1:9180/metrics",
    "edge_config": os.path.join(root, "edge.toml"),
    "control_plane_url": env["STATE_CONTROL_URL"],
    "control_plane_pid": num(env["STATE_CP_PID"]),
    "sandbox_url": env["STATE_SANDBOX_URL"],
    "sandbox_pid": num(env["STATE_SB_PID"]),
    "model_url": None,
    "keys_dir": env["STATE_KEYS"],
    "state_dir": root,
    "fault_cmd": env["STATE_FAULT_CMD"],
    "shards": {
        s: os.path.join(env["STATE_EXPORT"], s) for s in env["STATE_ALL_SHARDS"].split(",")
    },
    "replicas": replicas,
}
with open(out, "w") as handle:
    json.dump(state, handle, indent=2)
    handle.write("\n")
EOF
  mv "$STATE.tmp" "$STATE"
}

# -- partitions -----------------------------------------------------------------------------

# Drop NFS (TCP 2049) both ways inside the replica's namespace: its mount stops answering, the
# replica's HTTP listener does not. With `hard` the replica's storage calls block; past the
# server's lease its locks are revoked and its old descriptors fail once healed.
partition_on() {
  local netns=$1
  if is_partitioned "$netns"; then
    return 0
  fi
  if command -v nft >/dev/null 2>&1; then
    ip netns exec "$netns" nft -f - <<'EOF'
table inet fleet_fault {
  chain output { type filter hook output priority 0; tcp dport 2049 drop; }
  chain input { type filter hook input priority 0; tcp sport 2049 drop; }
}
EOF
  elif command -v iptables >/dev/null 2>&1; then
    ip netns exec "$netns" iptables -C OUTPUT -p tcp --dport 2049 -j DROP 2>/dev/null ||
      ip netns exec "$netns" iptables -I OUTPUT -p tcp --dport 2049 -j DROP
    ip netns exec "$netns" iptables -C INPUT -p tcp --sport 2049 -j DROP 2>/dev/null ||
      ip netns exec "$netns" iptables -I INPUT -p tcp --sport 2049 -j DROP
  else
    die "partition needs nft or iptables (Debian: nftables)"
  fi
}

partition_off() {
  local netns=$1
  if command -v nft >/dev/null 2>&1; then
    if ip netns exec "$netns" nft list table inet fleet_fault >/dev/null 2>&1; then
      ip netns exec "$netns" nft delete table inet fleet_fault
    fi
  fi
  if command -v iptables >/dev/null 2>&1; then
    while ip netns exec "$netns" iptables -D OUTPUT -p tcp --dport 2049 -j DROP 2>/dev/null; do :; done
    while ip netns exec "$netns" iptables -D INPUT -p tcp --sport 2049 -j DROP 2>/dev/null; do :; done
  fi
}

is_partitioned() {
  local netns=$1
  if command -v nft >/dev/null 2>&1 &&
    ip netns exec "$netns" nft list table inet fleet_fault >/dev/null 2>&1; then
    return 0
  fi
  command -v iptables >/dev/null 2>&1 &&
    ip netns exec "$netns" iptables -C OUTPUT -p tcp --dport 2049 -j DROP 2>/dev/null
}
