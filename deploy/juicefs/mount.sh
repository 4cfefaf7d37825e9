#!/usr/bin/env bash
# mount.sh VERB: a replica host's JuiceFS client, run with the options the fleet's storage
# design depends on (the same flags fleet_sim/juicefs/mount.py gives every simulated host).
#
#   mount.sh mount         run the client in the foreground until the volume is unmounted
#                          (systemd's ExecStart; by hand, run it in a second terminal)
#   mount.sh wait          wait until the mount answers and is on a shared bucket
#                          (systemd's ExecStartPost), at most JFS_START_TIMEOUT_S
#   mount.sh check         is it mounted and answering, with those options in effect, and what
#                          the metadata engine says about the volume and its sessions
#   mount.sh umount [--force]
#                          unmount (systemd's ExecStop); the client closes its session and exits
#   mount.sh argv          print the `juicefs mount` command line, one argument per line
#
# Settings come from the environment and from JFS_ENV_FILE [/etc/beyond-fleet/juicefs.env]
# (KEY=value lines; a variable already in the environment wins), see juicefs.env.example:
#   JFS_META_URL           the metadata engine, without a password (required)
#   META_PASSWORD, META_PASSWORD_FILE, SENTINEL_PASSWORD
#                          read by JuiceFS itself, never put on a command line
#   JFS_MOUNTPOINT [/mnt/jfs]  JFS_CACHE_DIR [/var/cache/beyond-fleet/juicefs]
#   JFS_CACHE_SIZE [1024] (MiB)  JFS_HEARTBEAT [2s]  JFS_METRICS [127.0.0.1:9567]
#   JFS_BACKUP_META [0]  JFS_BIN [juicefs on PATH]  JFS_EXTRA_ARGS [""]
#   JFS_START_TIMEOUT_S [30]  JFS_RETRY_BUDGET_S [120]  JFS_ALLOW_FILE_BUCKET [0]
# Exit status: 0 done, 1 failed (or `check` found a problem), 2 usage or configuration.
set -euo pipefail

PROG=mount.sh

die() {
  echo "$PROG: $*" >&2
  exit 1
}

config_error() {
  echo "$PROG: $*" >&2
  exit 2
}

usage() {
  # The comment block at the top of this file; to stderr when it answers a mistake.
  local code=${1:-2}
  if [ "$code" -eq 0 ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  else
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
  fi
  exit "$code"
}

KNOWN_KEYS=" JFS_META_URL JFS_MOUNTPOINT JFS_CACHE_DIR JFS_CACHE_SIZE JFS_HEARTBEAT JFS_METRICS \
JFS_BACKUP_META JFS_BIN JFS_EXTRA_ARGS JFS_START_TIMEOUT_S JFS_RETRY_BUDGET_S \
JFS_ALLOW_FILE_BUCKET META_PASSWORD META_PASSWORD_FILE SENTINEL_PASSWORD "

# KEY=value lines, read as data and never run as shell: the file is root's and this script
# runs as root. The format is the part systemd's EnvironmentFile= and a shell agree on, so the
# unit can load the same file. A key outside KNOWN_KEYS is an error: a misspelt setting would
# otherwise silently leave a default in place.
load_env_file() {
  local file=$1 line key value number=0 name from_env=" "
  [ -r "$file" ] || config_error "cannot read $file"
  for name in $KNOWN_KEYS; do
    [ -z "${!name+set}" ] || from_env+="$name "
  done
  if [ -n "$(find "$file" -maxdepth 0 -perm /o+r 2>/dev/null)" ] &&
    grep -Eq '^[[:space:]]*(META_PASSWORD|SENTINEL_PASSWORD)=' "$file"; then
    echo "$PROG: warning: $file holds a password and is readable by every user (chmod 600 it)" >&2
  fi
  while IFS= read -r line || [ -n "$line" ]; do
    number=$((number + 1))
    line=${line#"${line%%[![:space:]]*}"}
    line=${line%"${line##*[![:space:]]}"}
    case "$line" in '' | '#'*) continue ;; esac
    line=${line#export }
    [[ "$line" =~ ^([A-Z_][A-Z0-9_]*)=(.*)$ ]] ||
      config_error "$file:$number: expected KEY=value with an upper-case KEY (the line is not shown: it may hold a secret)"
    key=${BASH_REMATCH[1]}
    value=${BASH_REMATCH[2]}
    case "$KNOWN_KEYS" in *" $key "*) ;; *) config_error "$file:$number: unknown setting $key" ;; esac
    if [[ "$value" =~ ^\"(.*)\"$ ]] || [[ "$value" =~ ^\'(.*)\'$ ]]; then
      value=${BASH_REMATCH[1]}
    fi
    # The environment wins over the file; within the file, as for systemd, the last line does.
    case "$from_env" in *" $key "*) continue ;; esac
    printf -v "$key" '%s' "$value"
    export "${key?}"
  done <"$file"
}

load_settings() {
  if [ -n "${JFS_ENV_FILE:-}" ]; then
    load_env_file "$JFS_ENV_FILE"
  elif [ -e /etc/beyond-fleet/juicefs.env ]; then
    load_env_file /etc/beyond-fleet/juicefs.env
  fi
  META_URL=${JFS_META_URL:-}
  MOUNTPOINT=${JFS_MOUNTPOINT:-/mnt/jfs}
  CACHE_DIR=${JFS_CACHE_DIR:-/var/cache/beyond-fleet/juicefs}
  CACHE_SIZE=${JFS_CACHE_SIZE:-1024}
  HEARTBEAT=${JFS_HEARTBEAT:-2s}
  METRICS=${JFS_METRICS:-127.0.0.1:9567}
  BACKUP_META=${JFS_BACKUP_META:-0}
  START_TIMEOUT_S=${JFS_START_TIMEOUT_S:-30}
  RETRY_BUDGET_S=${JFS_RETRY_BUDGET_S:-120}
  ALLOW_FILE_BUCKET=${JFS_ALLOW_FILE_BUCKET:-0}
  if [ -n "${JFS_BIN:-}" ]; then
    JUICEFS=$JFS_BIN
  else
    JUICEFS=$(command -v juicefs || echo /usr/local/bin/juicefs)
  fi
  validate
}

# Seconds in a duration as JuiceFS writes one ("2s", "1500ms", "2"), for the arithmetic below.
duration_s() {
  case "$1" in
    *ms) awk -v v="${1%ms}" 'BEGIN { print v / 1000 }' ;;
    *s) echo "${1%s}" ;;
    *) echo "$1" ;;
  esac
}

validate() {
  [ -n "$META_URL" ] ||
    config_error "JFS_META_URL is not set (in ${JFS_ENV_FILE:-/etc/beyond-fleet/juicefs.env} or the environment)"
  # A password in the URL would be on the command line, so in `ps`, /proc/PID/cmdline and
  # whatever logs the unit's command.
  if [[ "$META_URL" =~ ^[a-z0-9+]+://[^/@]*:[^/@]*@ ]]; then
    config_error "JFS_META_URL carries a password: drop it from the URL and set META_PASSWORD or META_PASSWORD_FILE instead"
  fi
  case "$MOUNTPOINT" in /*) ;; *) config_error "JFS_MOUNTPOINT must be an absolute path, got '$MOUNTPOINT'" ;; esac
  case "$CACHE_DIR" in /*) ;; *) config_error "JFS_CACHE_DIR must be an absolute path, got '$CACHE_DIR'" ;; esac
  [[ "$CACHE_SIZE" =~ ^[0-9]+$ ]] || config_error "JFS_CACHE_SIZE is MiB as a whole number, got '$CACHE_SIZE'"
  [[ "$HEARTBEAT" =~ ^[0-9]+(\.[0-9]+)?(ms|s)?$ ]] ||
    config_error "JFS_HEARTBEAT must be a duration such as 2s or 1500ms, got '$HEARTBEAT'"
  [[ "$HEARTBEAT" =~ (ms|s)$ ]] || HEARTBEAT="${HEARTBEAT}s"
  [[ "$RETRY_BUDGET_S" =~ ^[0-9]+$ ]] || config_error "JFS_RETRY_BUDGET_S must be whole seconds, got '$RETRY_BUDGET_S'"
  [[ "$START_TIMEOUT_S" =~ ^[0-9]+$ ]] || config_error "JFS_START_TIMEOUT_S must be whole seconds, got '$START_TIMEOUT_S'"
  HEARTBEAT_S=$(duration_s "$HEARTBEAT")
  # A lost host's session, and every lock it held, expires 5 heartbeats after its last one and
  # is removed by the next sweep of a live client (about one heartbeat later). That has to end
  # well inside the edge's retry budget, or the sessions of a lost host are refused.
  if awk -v h="$HEARTBEAT_S" -v b="$RETRY_BUDGET_S" 'BEGIN { exit !(h * 6 >= b) }'; then
    config_error "JFS_HEARTBEAT $HEARTBEAT: a lost host's locks would be freed only after about $(awk -v h="$HEARTBEAT_S" 'BEGIN { print h * 6 }')s, past the edge's ${RETRY_BUDGET_S}s retry budget"
  fi
  # JuiceFS keeps a session's expiry in whole seconds, and 0 would make sessions never expire.
  if awk -v h="$HEARTBEAT_S" 'BEGIN { exit !(h < 1) }'; then
    config_error "JFS_HEARTBEAT must be at least 1s, got '$HEARTBEAT'"
  fi
  # Metrics cannot be switched off; they stay on this host (the fleet's rule for every listener).
  [[ "$METRICS" =~ ^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\]):[0-9]+$ ]] ||
    config_error "JFS_METRICS must be a loopback address and port (127.0.0.1:9567), got '$METRICS'"
  [[ "$BACKUP_META" =~ ^[0-9]+[smhd]?$ ]] ||
    config_error "JFS_BACKUP_META must be 0 or an interval such as 24h, got '$BACKUP_META'"
  EXTRA=()
  if [ -n "${JFS_EXTRA_ARGS:-}" ]; then
    read -r -a EXTRA <<<"$JFS_EXTRA_ARGS"
  fi
  local arg
  for arg in ${EXTRA[@]+"${EXTRA[@]}"}; do
    case "${arg%%=*}" in
      --writeback | --writeback-threshold-size | --upload-delay | --upload-hours)
        config_error "JFS_EXTRA_ARGS: $arg: an fsync must mean the block is in the object store; staged uploads would lose acknowledged turns with the host" ;;
      --no-bgjob)
        config_error "JFS_EXTRA_ARGS: $arg: background jobs include the sweep that frees a lost host's locks" ;;
      -d | --background)
        config_error "JFS_EXTRA_ARGS: $arg: the client runs in the foreground (systemd supervises it)" ;;
      --attr-cache | --entry-cache | --dir-entry-cache | --negative-entry-cache | --open-cache | \
        --heartbeat | --metrics | --no-usage-report | --backup-meta | --cache-dir | --cache-size | \
        --no-agent | --hide-internal)
        config_error "JFS_EXTRA_ARGS: $arg is set by this script (see its settings)" ;;
    esac
  done
}

# The client's command line. Keep it in step with mount_argv() in fleet_sim/juicefs/mount.py:
# tests/system/test_deploy_files.py compares the two.
mount_argv() {
  ARGV=(
    "$JUICEFS" mount
    --no-agent             # no pprof listener
    --no-usage-report      # JuiceFS reports usage to its vendor unless told not to
    --backup-meta "$BACKUP_META"
    --heartbeat "$HEARTBEAT"
    # The epoch fence looks a successor's segment up by name: nothing may answer from a cache.
    --attr-cache 0 --entry-cache 0 --dir-entry-cache 0 --negative-entry-cache 0 --open-cache 0
    --cache-dir "$CACHE_DIR"
    --cache-size "$CACHE_SIZE"
    # JuiceFS's virtual files (.accesslog, .stats, .config, .trash) stay reachable by name but
    # leave the root's listing, so a tool walking the tree never opens .accesslog, a read that
    # never ends.
    --hide-internal
    --metrics "$METRICS"
    ${EXTRA[@]+"${EXTRA[@]}"}
    "$META_URL"
    "$MOUNTPOINT"
  )
}

fstype_at() {
  # The 9th field of mountinfo after the optional fields' "-" separator is the fs type; the
  # last entry for a path is the one on top.
  awk -v mp="$1" '$5 == mp { for (i = 7; i <= NF; i++) if ($i == "-") { t = $(i + 1); break } }
    END { print t }' /proc/self/mountinfo
}

mounted() { [ "$(fstype_at "$MOUNTPOINT")" = fuse.juicefs ]; }

# Does the mount answer? A stat of its root, bounded: a hung client would block it for good.
answers() { [ "$(timeout 5 stat -c %i "$MOUNTPOINT" 2>/dev/null)" = 1 ]; }

# The mount's .config: the client's settings as JSON, a virtual file only root may read. Read
# once, with a deadline, since a hung client would block the read for good.
CONFIG_TEXT=
load_config() {
  CONFIG_TEXT=$(timeout 5 cat "$MOUNTPOINT/.config") ||
    die "cannot read $MOUNTPOINT/.config (is it a JuiceFS mount, and are you root?)"
}

# One value from it (JuiceFS writes it pretty-printed, one key a line; the keys asked for here
# occur once).
config_value() {
  sed -n "s/^[[:space:]]*\"$1\": \\(.*\\)\$/\\1/p" <<<"$CONFIG_TEXT" | head -n 1 |
    sed 's/,$//; s/^"//; s/"$//'
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "run as root: a FUSE mount for every user of the host needs it"
}

need_juicefs() {
  [ -x "$JUICEFS" ] || die "no juicefs binary at $JUICEFS (install it, or set JFS_BIN)"
}

cmd_mount() {
  need_root
  need_juicefs
  [ -e /dev/fuse ] || die "/dev/fuse is missing (load the fuse module; in a container, pass the device and CAP_SYS_ADMIN)"
  if mounted && answers; then
    load_config
    die "$MOUNTPOINT is already mounted by a live JuiceFS client (pid $(config_value PPid)); stop that one first"
  fi
  # A dead client's mount ("transport endpoint is not connected") is detached by juicefs
  # itself before it mounts again.
  mkdir -p "$MOUNTPOINT"
  install -d -m 0700 "$CACHE_DIR"
  mount_argv
  echo "$PROG: ${ARGV[*]}" >&2
  # exec: the JuiceFS supervisor becomes systemd's main process and gets its signals directly.
  exec "${ARGV[@]}"
}

cmd_wait() {
  local waited=0
  until mounted && answers; do
    # ExecStartPost gets the main process as MAINPID: stop waiting once it has gone.
    if [ -n "${MAINPID:-}" ] && ! kill -0 "$MAINPID" 2>/dev/null; then
      die "the JuiceFS client (pid $MAINPID) exited before $MOUNTPOINT was mounted"
    fi
    [ "$waited" -lt $((START_TIMEOUT_S * 4)) ] ||
      die "$MOUNTPOINT did not answer within ${START_TIMEOUT_S}s (journalctl -u beyond-fleet-juicefs)"
    sleep 0.25
    waited=$((waited + 1))
  done
  load_config
  local storage
  storage=$(config_value Storage)
  if [ "$storage" = file ] && [ "$ALLOW_FILE_BUCKET" != 1 ]; then
    "$JUICEFS" umount --no-agent "$MOUNTPOINT" >&2 || true
    die "the volume's data is in a 'file' bucket ($(config_value Bucket)), a directory on one machine: other hosts cannot read what this one writes. Format the volume on S3 or MinIO (or set JFS_ALLOW_FILE_BUCKET=1 for a single-box rehearsal)"
  fi
  echo "$PROG: $MOUNTPOINT is mounted (storage: $storage)" >&2
}

cmd_umount() {
  local force=()
  case "${1:-}" in
    '') ;;
    --force) force=(--force) ;;
    *) config_error "umount takes only --force" ;;
  esac
  need_root
  if ! mounted; then
    echo "$PROG: $MOUNTPOINT is not mounted" >&2
    return 0
  fi
  need_juicefs
  if ! "$JUICEFS" umount --no-agent ${force[@]+"${force[@]}"} "$MOUNTPOINT"; then
    die "could not unmount $MOUNTPOINT; if it is busy, stop what uses it first (fuser -vm $MOUNTPOINT), or '$PROG umount --force' to detach it lazily"
  fi
  # Unmounted, the client closes its session (releasing its locks at once rather than after 5
  # heartbeats) and exits; under systemd, give it the time to do so before any signal.
  if [ -n "${MAINPID:-}" ]; then
    local waited=0
    while kill -0 "$MAINPID" 2>/dev/null && [ "$waited" -lt 40 ]; do
      sleep 0.25
      waited=$((waited + 1))
    done
  fi
}

CHECK_FAILED=0
ok() { printf 'ok    %s\n' "$*"; }
warn() { printf 'WARN  %s\n' "$*"; }
bad() {
  printf 'FAIL  %s\n' "$*"
  CHECK_FAILED=1
}

# Want a .config duration (nanoseconds) to be exactly this many seconds.
want_duration() {
  local key=$1 seconds=$2 label=$3 got
  got=$(config_value "$key")
  if [ -z "$got" ]; then
    bad "$label: $key is not in $MOUNTPOINT/.config"
  elif awk -v g="$got" -v s="$seconds" 'BEGIN { exit !(g == s * 1e9) }'; then
    ok "$label: $(awk -v g="$got" 'BEGIN { print g / 1e9 }')s"
  else
    bad "$label is $(awk -v g="$got" 'BEGIN { print g / 1e9 }')s, want ${seconds}s (remount with this script)"
  fi
}

check_redis() {
  # What only the engine knows. Managed services often refuse CONFIG; then this says so.
  command -v redis-cli >/dev/null 2>&1 || {
    warn "redis: redis-cli is not installed, engine settings not checked (want appendonly yes, appendfsync always, maxmemory-policy noeviction)"
    return 0
  }
  case "$META_URL" in
    redis://* | rediss://*) ;;
    *) return 0 ;;
  esac
  local hosts=${META_URL#*://}
  hosts=${hosts%%/*}
  # The client's own options (max-retry-backoff, timeouts) mean nothing to redis-cli: drop
  # them. TLS options it would need, so a URL with those is checked on the servers instead.
  local cli_url=${META_URL%%\?*}
  if [[ "$META_URL" == *\?*tls* ]] || [[ "${hosts#*@}" == *,* ]]; then
    warn "redis: a Sentinel, cluster or TLS-option URL; check appendonly, appendfsync and maxmemory-policy on the servers themselves"
    return 0
  fi
  local password=${META_PASSWORD:-}
  if [ -z "$password" ] && [ -n "${META_PASSWORD_FILE:-}" ]; then
    password=$(cat "$META_PASSWORD_FILE")
  fi
  local got
  # The password reaches redis-cli through its environment (exported in this subshell only),
  # never through a command line.
  if ! got=$(
    [ -z "$password" ] || export REDISCLI_AUTH="$password"
    timeout 10 redis-cli --no-auth-warning -u "$cli_url" CONFIG GET '*' 2>&1 | paste - - |
      grep -E '^(appendonly|appendfsync|maxmemory-policy)[[:space:]]'
  ); then
    warn "redis: could not read its configuration (CONFIG may be disabled on a managed service)"
    return 0
  fi
  local name value
  while read -r name value; do
    case "$name=$value" in
      appendonly=yes | appendfsync=always | maxmemory-policy=noeviction) ok "redis: $name $value" ;;
      appendfsync=*) bad "redis: appendfsync $value, want always (otherwise a crash can lose metadata the clients were told is durable)" ;;
      *) bad "redis: $name $value, want $(case "$name" in appendonly) echo yes ;; *) echo noeviction ;; esac)" ;;
    esac
  done <<<"$got"
}

cmd_check() {
  need_root
  if ! mounted; then
    bad "$MOUNTPOINT: not a JuiceFS mount ($(fstype_at "$MOUNTPOINT" | sed 's/^$/nothing mounted/'))"
    return 1
  fi
  if ! answers; then
    bad "$MOUNTPOINT: mounted but does not answer within 5s (client stopped or its engine unreachable)"
    return 1
  fi
  load_config
  ok "$MOUNTPOINT: mounted and answering (volume $(config_value Name), JuiceFS $(config_value Version))"
  local pid ppid
  pid=$(config_value Pid)
  ppid=$(config_value PPid)
  ok "client: supervisor pid $ppid, worker pid $pid, session $(config_value Sid)"
  want_duration AttrTimeout 0 "attribute cache"
  want_duration EntryTimeout 0 "entry cache"
  want_duration DirEntryTimeout 0 "directory entry cache"
  want_duration NegEntryTimeout 0 "negative entry cache"
  want_duration OpenCache 0 "open cache"
  want_duration Heartbeat "$HEARTBEAT_S" "heartbeat"
  if [ "$(config_value HideInternal)" = true ]; then
    ok "internal files: out of listings (--hide-internal)"
  else
    warn "internal files: listed at the root; a tool that walks the tree and opens .accesslog will wait on it for good"
  fi
  if [ "$(config_value Writeback)" = false ]; then
    ok "writeback: off (an fsync returns once the block is in the object store)"
  else
    bad "writeback is on: acknowledged turns can be lost with the host"
  fi
  local backup
  backup=$(config_value BackupMeta)
  if [ "$backup" = 0 ]; then
    ok "metadata backup by the client: off"
  else
    warn "metadata backup by the client: every $(awk -v g="$backup" 'BEGIN { print g / 3.6e12 }')h (JFS_BACKUP_META)"
  fi
  local metrics
  metrics=$(config_value PrometheusAgent)
  if [[ "$metrics" =~ ^(127\.[0-9.]+|localhost|\[::1\]):[0-9]+$ ]]; then
    ok "metrics: $metrics"
  else
    bad "metrics listen on '$metrics', want a loopback address"
  fi
  # JuiceFS rewrites its own command line in place (to hide the engine URL), so the flags are
  # read as one space-separated string.
  if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -Eq -- ' --no-usage-report( |$)'; then
    ok "usage report: off"
  else
    bad "usage report: the client (pid $pid) was not started with --no-usage-report"
  fi
  local storage
  storage=$(config_value Storage)
  if [ "$storage" = file ]; then
    warn "storage: file ($(config_value Bucket)), a directory on one machine: fine for one box, never for several hosts"
  else
    ok "storage: $storage ($(config_value Bucket))"
  fi
  local status sessions
  if status=$(timeout 20 "$JUICEFS" status --no-agent "$META_URL" 2>/dev/null); then
    sessions=$(grep -c '"Sid":' <<<"$status" || true)
    local sid
    sid=$(config_value Sid)
    if grep -Eq "\"Sid\": $sid," <<<"$status"; then
      ok "engine: this client's session $sid is registered; $sessions sessions on the volume ($(sed -n 's/^ *"HostName": "\(.*\)",$/\1/p' <<<"$status" | sort | uniq -c | awk '{ printf "%s%s x%s", sep, $2, $1; sep = ", " }'))"
    else
      bad "engine: this client's session $sid is not registered (expired and not yet re-registered?)"
    fi
  else
    bad "engine: 'juicefs status' failed or took over 20s"
  fi
  check_redis
  return "$CHECK_FAILED"
}

[ $# -ge 1 ] || usage 2
VERB=$1
shift
case "$VERB" in
  -h | --help | help) usage 0 ;;
esac
load_settings
case "$VERB" in
  mount) cmd_mount ;;
  wait) cmd_wait ;;
  check) cmd_check ;;
  umount) cmd_umount "$@" ;;
  argv)
    mount_argv
    printf '%s\n' "${ARGV[@]}"
    ;;
  *) usage 2 ;;
esac
