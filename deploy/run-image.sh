#!/usr/bin/env bash
# A small fleet from the image with plain `docker run`: no compose file, one host.
#
#   deploy/run-image.sh up [--image IMAGE] [--replicas N] [--port PORT]
#   deploy/run-image.sh status
#   deploy/run-image.sh down [--purge]
#
# `up` creates (when missing) a network, a keys volume and a shards volume, then starts the
# sandbox simulator, the control plane, two slices of N replicas (a07-r1.., a08-r1..) and the
# edge, each as its own container running `fleet-role ROLE` (deploy/image/fleet-role.sh). The
# edge is published on 127.0.0.1:PORT and the control plane on 127.0.0.1:PORT+1; nothing listens
# on another address. Running it again starts only what is not running. `down` removes the
# containers and the network and keeps the volumes (the keys and every session) unless --purge.
#
# Storage: by default the shards volume is a local Docker volume, so this is the local-directory
# substrate in containers. To put it on NFS, set FLEET_NFS_ADDR (server address) and
# FLEET_NFS_EXPORT (exported path, owned by uid 10001) before the first `up`: the volume is then
# an NFS mount with the options deploy/attached-local/README.md explains. All containers share
# the Docker host's one mount, so this shows NFS latency, not NFS lease behaviour; for that use
# deploy/attached-local/.
#
# Settings: FLEET_IMAGE [beyond-fleet:latest], FLEET_PREFIX [fleet] (names of everything created),
# FLEET_MODEL [mock], FLEET_DRAIN_GRACE_S [30].
set -euo pipefail

PREFIX=${FLEET_PREFIX:-fleet}
IMAGE=${FLEET_IMAGE:-beyond-fleet:latest}
REPLICAS=3
PORT=8080
PURGE=0
SLICES="a07:s1,s2 a08:s1,s2"
DRAIN_GRACE_S=${FLEET_DRAIN_GRACE_S:-30}

die() {
  echo "run-image: $*" >&2
  exit 1
}

usage() {
  sed -n '2,6p' "$0" >&2
  exit 2
}

[ $# -ge 1 ] || usage
COMMAND=$1
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --image) IMAGE=${2:?--image needs a value}; shift 2 ;;
    --replicas) REPLICAS=${2:?--replicas needs a value}; shift 2 ;;
    --port) PORT=${2:?--port needs a value}; shift 2 ;;
    --purge) PURGE=1; shift ;;
    -h | --help) usage ;;
    *) die "unknown option $1" ;;
  esac
done
case "$REPLICAS" in
  '' | *[!0-9]* | 0) die "--replicas must be a positive number, got '$REPLICAS'" ;;
esac
case "$PORT" in
  '' | *[!0-9]*) die "--port must be a number, got '$PORT'" ;;
esac

NETWORK="$PREFIX-net"
KEYS_VOLUME="$PREFIX-keys"
SHARDS_VOLUME="$PREFIX-shards"
LABEL="beyond-fleet=$PREFIX"
ROLE_LABEL="beyond-fleet.role"

need_docker() {
  command -v docker >/dev/null 2>&1 ||
    die "docker is not installed (this script drives the Docker engine with 'docker run')"
  docker info >/dev/null 2>&1 ||
    die "the Docker engine is not reachable ('docker info' failed): start it, or check DOCKER_HOST and your permissions"
}

replica_names() {
  local spec i
  for spec in $SLICES; do
    for ((i = 1; i <= REPLICAS; i++)); do
      echo "${spec%%:*}-r$i"
    done
  done
}

ensure_network() {
  docker network inspect "$NETWORK" >/dev/null 2>&1 ||
    docker network create --label "$LABEL" "$NETWORK" >/dev/null
}

ensure_volumes() {
  docker volume inspect "$KEYS_VOLUME" >/dev/null 2>&1 ||
    docker volume create --label "$LABEL" "$KEYS_VOLUME" >/dev/null
  if ! docker volume inspect "$SHARDS_VOLUME" >/dev/null 2>&1; then
    if [ -n "${FLEET_NFS_ADDR:-}" ]; then
      [ -n "${FLEET_NFS_EXPORT:-}" ] || die "FLEET_NFS_ADDR is set but FLEET_NFS_EXPORT is not"
      docker volume create --label "$LABEL" --driver local --opt type=nfs \
        --opt "o=addr=$FLEET_NFS_ADDR,nfsvers=4.2,hard,lookupcache=positive,actimeo=1" \
        --opt "device=:$FLEET_NFS_EXPORT" "$SHARDS_VOLUME" >/dev/null
    else
      docker volume create --label "$LABEL" "$SHARDS_VOLUME" >/dev/null
    fi
  fi
  # New local volumes belong to root; the fleet runs as uid 10001. An NFS export is the
  # server's to get right (root is squashed there), so it is left alone.
  if [ -z "${FLEET_NFS_ADDR:-}" ]; then
    docker run --rm --user 0 --entrypoint chown -v "$KEYS_VOLUME:/keys" \
      -v "$SHARDS_VOLUME:/shards" "$IMAGE" 10001:10001 /keys /shards
  fi
}

# Start NAME from the image unless it is already running; a stopped one is started again as it
# was created (same flags), so `up` after a crash or a `docker stop` is the repair.
run_container() {
  local name=$1
  shift
  local running
  if running=$(docker container inspect --format '{{.State.Running}}' "$name" 2>/dev/null); then
    if [ "$running" = true ]; then
      echo "  $name: running"
    else
      docker start "$name" >/dev/null
      echo "  $name: started again"
    fi
    return 0
  fi
  docker run --detach --name "$name" --hostname "$name" --network "$NETWORK" --label "$LABEL" \
    --restart unless-stopped "$@" >/dev/null
  echo "  $name: created"
}

common_env() {
  printf '%s\n' \
    -e "FLEET_SLICES=$SLICES" \
    -e "FLEET_REPLICAS_PER_SLICE=$REPLICAS" \
    -e "FLEET_REPLICA_URL_PATTERN=http://$PREFIX-{name}:9101" \
    -e "FLEET_EDGE_URL=http://$PREFIX-edge:8080" \
    -e "FLEET_CONTROL_URL=http://$PREFIX-control:7800" \
    -e "FLEET_SANDBOX_URL=http://$PREFIX-sandbox:7700"
}

wait_ready() {
  local waited=0
  until docker exec "$PREFIX-edge" python -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=2)" \
    >/dev/null 2>&1; do
    [ "$waited" -lt 90 ] || die "the edge is not ready after 90s: docker logs $PREFIX-edge"
    sleep 1
    waited=$((waited + 1))
  done
}

cmd_up() {
  need_docker
  docker image inspect "$IMAGE" >/dev/null 2>&1 ||
    die "image $IMAGE not found: build it with 'docker build -t $IMAGE .' at the repository root"
  ensure_network
  ensure_volumes
  local env=() name
  mapfile -t env < <(common_env)
  echo "starting $PREFIX from $IMAGE"
  run_container "$PREFIX-sandbox" "${env[@]}" -v "$KEYS_VOLUME:/keys" "$IMAGE" \
    fleet-role sandbox
  run_container "$PREFIX-control" "${env[@]}" -v "$KEYS_VOLUME:/keys" \
    -p "127.0.0.1:$((PORT + 1)):7800" "$IMAGE" fleet-role control-plane
  while read -r name; do
    run_container "$PREFIX-$name" "${env[@]}" --label "$ROLE_LABEL=replica" \
      -e "FLEET_REPLICA_NAME=$name" \
      -e "FLEET_CREATE_SHARDS=1" -e "FLEET_MODEL=${FLEET_MODEL:-mock}" \
      -e "FLEET_DRAIN_GRACE_S=$DRAIN_GRACE_S" --stop-timeout "$((DRAIN_GRACE_S + 10))" \
      -v "$KEYS_VOLUME:/keys:ro" -v "$SHARDS_VOLUME:/shards" "$IMAGE" fleet-role replica
  done < <(replica_names)
  run_container "$PREFIX-edge" "${env[@]}" -p "127.0.0.1:$PORT:8080" "$IMAGE" fleet-role edge
  wait_ready
  cat <<EOF

The fleet is up: edge http://127.0.0.1:$PORT, control plane http://127.0.0.1:$((PORT + 1))
  curl -d '{"tenant":"demo"}' http://127.0.0.1:$((PORT + 1))/v1/sessions
  then: curl -H "x-beyond-grant: \$GRANT" -H 'content-type: application/json' \\
          -d '{"type":"prompt","message":"hello"}' \\
          "http://127.0.0.1:$PORT/_beyond/agent?session_id=\$SID"
Faults: docker kill --signal KILL $PREFIX-a07-r1   (a hard loss; the container restarts)
        docker stop $PREFIX-a07-r1                 (a drain; '$0 up' starts it again)
EOF
}

cmd_status() {
  need_docker
  docker ps --all --filter "label=$LABEL" --format 'table {{.Names}}\t{{.Status}}\t{{.Ports}}'
}

cmd_down() {
  need_docker
  local ids
  ids=$(docker ps --all --quiet --filter "label=$LABEL")
  if [ -n "$ids" ]; then
    # Replicas first so they drain (docker stop sends SIGTERM and waits --stop-timeout).
    local replicas
    replicas=$(docker ps --quiet --filter "label=$LABEL" --filter "label=$ROLE_LABEL=replica")
    if [ -n "$replicas" ]; then
      # shellcheck disable=SC2086 # one argument per container id
      docker stop $replicas >/dev/null
    fi
    # shellcheck disable=SC2086 # one argument per container id
    docker rm --force $ids >/dev/null
  fi
  if docker network inspect "$NETWORK" >/dev/null 2>&1; then
    docker network rm "$NETWORK" >/dev/null
  fi
  if [ "$PURGE" = 1 ]; then
    docker volume rm --force "$KEYS_VOLUME" "$SHARDS_VOLUME" >/dev/null
    echo "removed $PREFIX: containers, network, volumes"
  else
    echo "removed $PREFIX containers and network; volumes $KEYS_VOLUME and $SHARDS_VOLUME kept"
  fi
}

case "$COMMAND" in
  up) cmd_up ;;
  status) cmd_status ;;
  down) cmd_down ;;
  *) usage ;;
esac
