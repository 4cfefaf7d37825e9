#!/usr/bin/env bash
# fleet-role ROLE [EXTRA ARGS...]: start one process of the fleet from environment variables.
#
# The image's entry point for orchestrators that hand a container environment variables rather
# than files (ECS task definitions, `docker run -e`, deploy/run-image.sh). Every role ends in
# `exec`, so the process it starts is the direct child of tini and receives its signals.
#
# Roles and what they read (defaults in brackets):
#   keys           write a keyset into FLEET_KEYS_DIR unless one is there
#   sandbox        the sandbox exec simulator on FLEET_LISTEN [0.0.0.0:7700],
#                  workspaces under FLEET_SANDBOX_ROOT [$HOME/sandboxes]
#   control-plane  the control plane on FLEET_LISTEN [0.0.0.0:7800]; writes the keyset first
#                  when there is none; needs FLEET_SANDBOX_URL and FLEET_EDGE_URL
#   replica        fleet-replica serve for FLEET_REPLICA_NAME (e.g. a07-r1; the slice is the part
#                  before the first "-", or FLEET_REPLICA_SLICE) on FLEET_LISTEN [0.0.0.0:9101],
#                  its slice's shards under FLEET_SHARD_ROOT [/shards]; needs FLEET_EDGE_URL
#                  (or FLEET_NOTIFY_ORIGIN) and FLEET_CONTROL_URL
#   edge           fleet-edge serve on FLEET_LISTEN [0.0.0.0:8080] with a config rendered from
#                  FLEET_SLICES, FLEET_REPLICAS_PER_SLICE and FLEET_REPLICA_URL_PATTERN
#   model          the OpenAI-compatible scripted model server on FLEET_LISTEN [0.0.0.0:8400]
#   driver         writes a state file for this fleet, waits for it, then runs the scenario
#                  matrix and a soak against it (see deploy/efs-proof/results/README.md)
#   scrape [PORT]  print this container's loopback metrics (replica 9102, edge 9180), for
#                  `docker exec` and ECS Exec, where the listener cannot be reached from outside
#
# Shared settings:
#   FLEET_KEYS_DIR            [/keys/fleet]  the keyset (fleet-sim keys layout)
#   FLEET_SANDBOX_SECRET      [/keys/sandbox/secret.key]
#   FLEET_SLICES              ["a07:s1,s2 a08:s1,s2"]  slices and their shards
#   FLEET_REPLICAS_PER_SLICE  [3]  replicas are named SLICE-r1 .. SLICE-rN
#   FLEET_REPLICA_URL_PATTERN ["http://{name}:9101"]  {name} becomes the replica's name
#   FLEET_REPLICA_URLS        [""]  "NAME=URL ..." pairs that override the pattern
#   FLEET_WAIT_S              [180]  how long a role waits for the keyset or a peer
set -euo pipefail

die() {
  echo "fleet-role: $*" >&2
  exit 2
}

KEYS_DIR=${FLEET_KEYS_DIR:-/keys/fleet}
SANDBOX_SECRET=${FLEET_SANDBOX_SECRET:-/keys/sandbox/secret.key}
SLICES=${FLEET_SLICES:-"a07:s1,s2 a08:s1,s2"}
PER_SLICE=${FLEET_REPLICAS_PER_SLICE:-3}
URL_PATTERN=${FLEET_REPLICA_URL_PATTERN:-"http://{name}:9101"}
WAIT_S=${FLEET_WAIT_S:-180}

case "$PER_SLICE" in
  '' | *[!0-9]*) die "FLEET_REPLICAS_PER_SLICE must be a number, got '$PER_SLICE'" ;;
esac
case "$WAIT_S" in
  '' | *[!0-9]*) die "FLEET_WAIT_S must be a whole number of seconds, got '$WAIT_S'" ;;
esac

require() {
  local name=$1
  [ -n "${!name:-}" ] || die "$name must be set for role '$ROLE'"
}

# Wait (bounded) for a file another container writes, e.g. the keyset on a shared volume.
wait_for_file() {
  local path=$1 waited=0
  while [ ! -s "$path" ]; do
    if [ "$waited" -ge "$WAIT_S" ]; then
      die "gave up after ${WAIT_S}s waiting for $path"
    fi
    sleep 1
    waited=$((waited + 1))
  done
}

# Wait (bounded) for an HTTP endpoint to answer 200, using only the standard library.
wait_for_url() {
  python - "$1" "$WAIT_S" <<'EOF'
import sys, time, urllib.request
url, limit = sys.argv[1], float(sys.argv[2])
deadline = time.monotonic() + limit
while True:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            if response.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"fleet-role: {url} did not answer 200 within {limit:.0f}s")
    time.sleep(1)
EOF
}

# "a07:s1,s2" -> the shard names of slice $1, one per line ("a07-s1", "a07-s2").
slice_shards() {
  local want=$1 spec name shards shard
  for spec in $SLICES; do
    name=${spec%%:*}
    shards=${spec#*:}
    [ "$name" = "$want" ] || continue
    for shard in ${shards//,/ }; do
      echo "$name-$shard"
    done
    return 0
  done
  die "slice '$want' is not in FLEET_SLICES ('$SLICES')"
}

slice_names() {
  local spec
  for spec in $SLICES; do
    echo "${spec%%:*}"
  done
}

replica_url() {
  local entry
  for entry in ${FLEET_REPLICA_URLS:-}; do
    if [ "${entry%%=*}" = "$1" ]; then
      echo "${entry#*=}"
      return 0
    fi
  done
  echo "${URL_PATTERN//\{name\}/$1}"
}

ensure_keys() {
  if [ -s "$KEYS_DIR/grant-keys.txt" ]; then
    return 0
  fi
  mkdir -p "$(dirname "$KEYS_DIR")"
  fleet-sim keys --dir "$KEYS_DIR"
}

role_sandbox() {
  local root=${FLEET_SANDBOX_ROOT:-$HOME/sandboxes}
  mkdir -p "$root"
  mkdir -p "$(dirname "$SANDBOX_SECRET")"
  chmod 700 "$(dirname "$SANDBOX_SECRET")"
  exec python -m fleet_sim.sandbox --listen "${FLEET_LISTEN:-0.0.0.0:7700}" --root "$root" \
    --secret-file "$SANDBOX_SECRET" "$@"
}

role_control_plane() {
  require FLEET_SANDBOX_URL
  require FLEET_EDGE_URL
  ensure_keys
  wait_for_file "$SANDBOX_SECRET"
  local args=() spec
  for spec in $SLICES; do
    args+=(--slice "$spec")
  done
  if [ -n "${FLEET_JOURNAL:-}" ]; then
    args+=(--journal "$FLEET_JOURNAL")
  fi
  exec python -m fleet_sim.control_plane --listen "${FLEET_LISTEN:-0.0.0.0:7800}" \
    --keys "$KEYS_DIR" --sandbox-url "$FLEET_SANDBOX_URL" --sandbox-secret "$SANDBOX_SECRET" \
    --edge-url "$FLEET_EDGE_URL" "${args[@]}" "$@"
}

role_replica() {
  require FLEET_REPLICA_NAME
  require FLEET_CONTROL_URL
  local name=$FLEET_REPLICA_NAME
  local slice=${FLEET_REPLICA_SLICE:-${name%%-*}}
  local origin=${FLEET_NOTIFY_ORIGIN:-${FLEET_EDGE_URL:-}}
  [ -n "$origin" ] || die "FLEET_NOTIFY_ORIGIN or FLEET_EDGE_URL must be set for role 'replica'"
  local shard_root=${FLEET_SHARD_ROOT:-/shards}
  local args=() shard line
  while read -r shard; do
    # A shard that is not mounted must stay missing (the replica reports it not ready); only a
    # single-host rehearsal on a plain volume asks for the directories to be created.
    if [ "${FLEET_CREATE_SHARDS:-0}" = 1 ]; then
      mkdir -p "$shard_root/$shard"
    fi
    args+=(--shard "$shard=$shard_root/$shard")
  done < <(slice_shards "$slice")
  wait_for_file "$KEYS_DIR/grant-keys.txt"
  while read -r line; do
    [ -n "$line" ] && args+=(--grant-key "$line")
  done <"$KEYS_DIR/grant-keys.txt"
  if [ -n "${FLEET_MAX_LIVE_SESSIONS:-}" ]; then
    args+=(--max-live-sessions "$FLEET_MAX_LIVE_SESSIONS")
  fi
  exec fleet-replica serve --service --listen "${FLEET_LISTEN:-0.0.0.0:9101}" --name "$name" \
    --seal-key "$KEYS_DIR/seal.key" --notify-key "$KEYS_DIR/notify.key" \
    --notify-origin "$origin" --lifecycle-url "${FLEET_CONTROL_URL%/}/v1/lifecycle" \
    --model "${FLEET_MODEL:-mock}" --drain-grace "${FLEET_DRAIN_GRACE_S:-30}" \
    --session-idle-timeout "${FLEET_IDLE_TIMEOUT_S:-60}" \
    --metrics-listen "127.0.0.1:${FLEET_METRICS_PORT:-9102}" "${args[@]}" "$@"
}

render_edge_config() {
  local slice i name
  echo "[edge]"
  echo "retry_budget_s = ${FLEET_RETRY_BUDGET_S:-120}"
  while read -r slice; do
    echo
    echo "[[slice]]"
    echo "name = \"$slice\""
    echo "replicas = ["
    for ((i = 1; i <= PER_SLICE; i++)); do
      name="$slice-r$i"
      echo "  { name = \"$name\", url = \"$(replica_url "$name")\" },"
    done
    echo "]"
  done < <(slice_names)
}

role_edge() {
  local config=${FLEET_EDGE_CONFIG:-/tmp/fleet-edge.toml}
  render_edge_config >"$config"
  exec fleet-edge serve --config "$config" --listen "${FLEET_LISTEN:-0.0.0.0:8080}" \
    --metrics-listen "127.0.0.1:${FLEET_METRICS_PORT:-9180}" "$@"
}

role_model() {
  exec python -m fleet_sim.model_server --listen "${FLEET_LISTEN:-0.0.0.0:8400}" "$@"
}

# The state file a driver hands `fleet-sim matrix --substrate attached`: the shape
# `fleet-sim up --state` writes, with pids unknown (the processes are in other tasks) and the
# shard paths as this container mounts them (read-only, for the graders).
write_driver_state() {
  local state=$1 slice i name
  local rows=()
  while read -r slice; do
    for ((i = 1; i <= PER_SLICE; i++)); do
      name="$slice-r$i"
      rows+=("$name" "$slice" "$(replica_url "$name")" "$(slice_shards "$slice" | paste -sd, -)")
    done
  done < <(slice_names)
  python - "$state" "${FLEET_SHARD_ROOT:-/shards}" "${rows[@]}" <<'EOF'
import json, os, sys
state, shard_root, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
replicas = []
for at in range(0, len(rows), 4):
    name, slice_name, url, shards = rows[at : at + 4]
    replicas.append({
        "name": name,
        "slice": slice_name,
        "url": url,
        "metrics_url": None,
        "pid": None,
        "shards": {s: os.path.join(shard_root, s) for s in shards.split(",")},
    })
env = os.environ
document = {
    "substrate": env.get("FLEET_SUBSTRATE_LABEL", "attached"),
    "edge_url": env["FLEET_EDGE_URL"],
    "edge_pid": None,
    "edge_metrics_url": None,
    "edge_config": None,
    "control_plane_url": env["FLEET_CONTROL_URL"],
    "control_plane_pid": None,
    "sandbox_url": env["FLEET_SANDBOX_URL"],
    "sandbox_pid": None,
    "model_url": None,
    "keys_dir": env.get("FLEET_KEYS_DIR", "/keys/fleet"),
    "state_dir": os.path.dirname(os.path.abspath(state)),
    "replicas": replicas,
}
with open(state, "w") as handle:
    json.dump(document, handle, indent=2)
    handle.write("\n")
EOF
}

role_driver() {
  require FLEET_EDGE_URL
  require FLEET_CONTROL_URL
  require FLEET_SANDBOX_URL
  local run=${FLEET_RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
  local out=${FLEET_RESULTS_DIR:-$HOME/results}/$run
  local fault=${FLEET_FAULT_CMD:-efs-fault}
  mkdir -p "$out"
  write_driver_state "$out/state.json"
  wait_for_file "$KEYS_DIR/grant-keys.txt"
  wait_for_url "${FLEET_CONTROL_URL%/}/healthz"
  wait_for_url "${FLEET_EDGE_URL%/}/readyz"
  local slice i
  while read -r slice; do
    for ((i = 1; i <= PER_SLICE; i++)); do
      wait_for_url "$(replica_url "$slice-r$i")/readyz"
    done
  done < <(slice_names)

  # Each step's exit status is recorded rather than stopping the run: a failed claim in the
  # matrix is a result, and the soak still has something to say.
  local status=0 rc
  {
    echo "run: $run"
    echo "started: $(date -u +%FT%TZ)"
    echo "image: ${FLEET_IMAGE:-unknown}"
  } >"$out/run.txt"
  set +e
  # shellcheck disable=SC2086 # FLEET_MATRIX_ARGS is a list of flags on purpose
  fleet-sim matrix --substrate attached --state "$out/state.json" --fault-cmd "$fault" \
    --results "$out/matrix" ${FLEET_MATRIX_ARGS:-} 2>&1 | tee "$out/matrix.log"
  rc=${PIPESTATUS[0]}
  echo "matrix: exit $rc" >>"$out/run.txt"
  [ "$rc" -eq 0 ] || status=1
  if [ "${FLEET_SOAK_S:-0}" != 0 ]; then
    # shellcheck disable=SC2086
    fleet-sim soak --substrate attached --state "$out/state.json" --fault-cmd "$fault" \
      --duration "$FLEET_SOAK_S" --sessions "${FLEET_SOAK_SESSIONS:-20}" \
      --results "$out/soak" ${FLEET_SOAK_ARGS:-} 2>&1 | tee "$out/soak.log"
    rc=${PIPESTATUS[0]}
    echo "soak: exit $rc" >>"$out/run.txt"
    [ "$rc" -eq 0 ] || status=1
  fi
  set -e
  echo "finished: $(date -u +%FT%TZ)" >>"$out/run.txt"
  if [ -n "${FLEET_RESULTS_BUCKET:-}" ]; then
    aws s3 cp --recursive --only-show-errors "$out" "s3://$FLEET_RESULTS_BUCKET/results/$run"
    echo "fleet-role: results in s3://$FLEET_RESULTS_BUCKET/results/$run" >&2
  fi
  exit "$status"
}

role_scrape() {
  python - "${1:-9102}" <<'EOF'
import sys, urllib.request
url = f"http://127.0.0.1:{int(sys.argv[1])}/metrics"
with urllib.request.urlopen(url, timeout=5) as response:
    sys.stdout.write(response.read().decode())
EOF
}

[ $# -ge 1 ] || die "usage: fleet-role keys|sandbox|control-plane|replica|edge|model|driver|scrape [ARGS...]"
ROLE=$1
shift
case "$ROLE" in
  keys) ensure_keys ;;
  sandbox) role_sandbox "$@" ;;
  control-plane) role_control_plane "$@" ;;
  replica) role_replica "$@" ;;
  edge) role_edge "$@" ;;
  model) role_model "$@" ;;
  driver) role_driver "$@" ;;
  scrape) role_scrape "$@" ;;
  *) die "unknown role '$ROLE' (keys, sandbox, control-plane, replica, edge, model, driver, scrape)" ;;
esac
