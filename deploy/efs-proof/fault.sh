#!/usr/bin/env bash
# Faults for the EFS proof's fleet on ECS: `fault.sh VERB [REPLICA]`, REPLICA like a07-r1.
#
#   kill R       kill -9 of the replica process inside its task, through ECS Exec. tini (PID 1)
#                exits with it, the task stops, and ECS starts a new one; waits for the stop
#   lose R       partition R, then kill it: its locks wait out the EFS lease (heal R afterwards)
#   term R       stop the task: ECS sends SIGTERM (a drain), SIGKILL after stopTimeout; waits
#   pause R      SIGSTOP the replica through ECS Exec (held past the container health check's
#   resume R     ~40 s, ECS replaces the task) / SIGCONT
#                (drain, freeze and thaw are taken for term, pause and resume, as `fleet-sim
#                fault` names them)
#   restart R    wait until R's service runs its task again (ECS restarts it by itself)
#   partition R  deny TCP 2049 between R's task address and the storage subnet (network ACL)
#   heal R       remove those entries
#   hang R       the same entries, lifted before the lease lapses / unhang R removes them
#   deploy R|all rolling deploy: force a new deployment of R's service (all: one replica at a
#                time), waiting for each to settle
#   metrics R    print R's Prometheus scrape, read inside its task
#   status       every service's running/desired count and the storage ACL's deny entries
#
# Finds the fleet from EFS_PROOF_CLUSTER and EFS_PROOF_NACL (the driver task has both) or else
# from the outputs of stack EFS_PROOF_STACK (default beyond-fleet-efs-proof). Needs the AWS CLI,
# and for ECS Exec verbs the Session Manager plugin. Exit status: 0 done, 1 failed, 2 usage.
set -euo pipefail

STACK=${EFS_PROOF_STACK:-beyond-fleet-efs-proof}
CLUSTER=${EFS_PROOF_CLUSTER:-}
NACL=${EFS_PROOF_NACL:-}
REPLICA_BIN=/opt/fleet/bin/fleet-replica

die() {
  echo "efs-proof fault: $*" >&2
  exit 1
}

usage() {
  sed -n '2,24p' "$0" >&2
  exit 2
}

[ $# -ge 1 ] || usage
VERB=$1
TARGET=${2:-}

command -v aws >/dev/null 2>&1 || die "the AWS CLI (aws) is not installed"

output() {
  aws cloudformation describe-stacks --stack-name "$STACK" \
    --query "Stacks[0].Outputs[?OutputKey=='$1'].OutputValue" --output text
}

resolve() {
  if [ -z "$CLUSTER" ]; then
    CLUSTER=$(output ClusterName) || die "cannot read stack $STACK (set EFS_PROOF_STACK?)"
  fi
  if [ -z "$NACL" ]; then
    NACL=$(output StorageNetworkAcl)
  fi
  if [ -z "$CLUSTER" ] || [ "$CLUSTER" = None ]; then
    die "stack $STACK has no ClusterName output"
  fi
}

need_replica() {
  [ -n "$TARGET" ] || usage
  [[ "$TARGET" =~ ^a0[78]-r[1-4]$ ]] || die "'$TARGET' is not a replica name (a07-r1 .. a08-r4)"
  resolve
}

service_of() { echo "$STACK-$1"; }

# NACL rule numbers: below the allow entries at 200, one pair per replica slot.
rule_of() {
  local slice=${1%%-r*} n=${1##*-r}
  if [ "$slice" = a07 ]; then echo $((100 + n)); else echo $((110 + n)); fi
}

task_of() {
  local task
  task=$(aws ecs list-tasks --cluster "$CLUSTER" --service-name "$(service_of "$1")" \
    --desired-status RUNNING --query 'taskArns[0]' --output text)
  if [ -z "$task" ] || [ "$task" = None ]; then
    die "$1 has no running task"
  fi
  echo "$task"
}

task_ip() {
  local ip
  ip=$(aws ecs describe-tasks --cluster "$CLUSTER" --tasks "$1" \
    --query "tasks[0].attachments[0].details[?name=='privateIPv4Address'].value | [0]" \
    --output text)
  [[ "$ip" =~ ^[0-9.]+$ ]] || die "cannot find the address of task $1"
  echo "$ip"
}

# ECS Exec runs the command without a shell, split on spaces: keep it to plain words.
exec_in() {
  local task=$1
  shift
  aws ecs execute-command --cluster "$CLUSTER" --task "$task" --container replica \
    --interactive --command "$*"
}

signal_replica() {
  local task
  task=$(task_of "$TARGET")
  # The session's output goes to stderr: stdout carries only the task, for the caller.
  exec_in "$task" pkill "-$1" -f "$REPLICA_BIN" >&2
  echo "$task"
}

wait_stopped() {
  aws ecs wait tasks-stopped --cluster "$CLUSTER" --tasks "$1"
}

wait_stable() {
  aws ecs wait services-stable --cluster "$CLUSTER" --services "$(service_of "$1")"
}

partition() {
  local ip rule
  ip=$(task_ip "$(task_of "$TARGET")")
  rule=$(rule_of "$TARGET")
  # NFS requests to the mount target, and its answers back to the replica's (ephemeral) port.
  acl_entry create --ingress "$rule" "$ip" 2049 2>/dev/null ||
    acl_entry replace --ingress "$rule" "$ip" 2049
  acl_entry create --egress "$rule" "$ip" 0-65535 2>/dev/null ||
    acl_entry replace --egress "$rule" "$ip" 0-65535
  echo "partitioned $TARGET ($ip) from EFS: $NACL rule $rule"
}

acl_entry() {
  local how=$1 direction=$2 rule=$3 ip=$4 ports=$5
  aws ec2 "$how-network-acl-entry" --network-acl-id "$NACL" "$direction" \
    --rule-number "$rule" --protocol 6 --port-range "From=${ports%-*},To=${ports#*-}" \
    --cidr-block "$ip/32" --rule-action deny
}

heal() {
  local rule direction
  rule=$(rule_of "$TARGET")
  for direction in --ingress --egress; do
    aws ec2 delete-network-acl-entry --network-acl-id "$NACL" "$direction" \
      --rule-number "$rule" 2>/dev/null || true
  done
  echo "healed $TARGET: $NACL rule $rule removed"
}

replica_names() {
  local slice n count=${EFS_PROOF_REPLICAS_PER_SLICE:-${FLEET_REPLICAS_PER_SLICE:-}}
  if [ -z "$count" ]; then
    count=$(output ReplicasPerSlice)
  fi
  for slice in a07 a08; do
    for ((n = 1; n <= count; n++)); do
      echo "$slice-r$n"
    done
  done
}

deploy_one() {
  aws ecs update-service --cluster "$CLUSTER" --service "$(service_of "$1")" \
    --force-new-deployment --query 'service.serviceName' --output text >/dev/null
  wait_stable "$1"
  echo "deployed $1"
}

status() {
  local name
  printf '%-10s %s\n' REPLICA 'RUNNING/DESIRED'
  while read -r name; do
    printf '%-10s %s\n' "$name" "$(aws ecs describe-services --cluster "$CLUSTER" \
      --services "$(service_of "$name")" \
      --query 'services[0].[runningCount,desiredCount]' --output text | tr '\t' /)"
  done < <(replica_names)
  echo "storage ACL $NACL deny entries:"
  aws ec2 describe-network-acls --network-acl-ids "$NACL" \
    --query "NetworkAcls[0].Entries[?RuleAction=='deny' && RuleNumber<\`200\`].[RuleNumber,Egress,CidrBlock]" \
    --output text
}

case "$VERB" in
  kill)
    need_replica
    wait_stopped "$(signal_replica KILL)"
    ;;
  lose)
    need_replica
    partition
    wait_stopped "$(signal_replica KILL)"
    ;;
  term | drain)
    need_replica
    task=$(task_of "$TARGET")
    aws ecs stop-task --cluster "$CLUSTER" --task "$task" --reason "fault.sh term" \
      --query 'task.lastStatus' --output text >/dev/null
    wait_stopped "$task"
    ;;
  pause | freeze) need_replica; signal_replica STOP >/dev/null ;;
  resume | thaw) need_replica; signal_replica CONT >/dev/null ;;
  restart) need_replica; wait_stable "$TARGET" ;;
  partition | hang) need_replica; partition ;;
  heal | unhang) need_replica; heal ;;
  deploy)
    [ -n "$TARGET" ] || usage
    if [ "$TARGET" = all ]; then
      resolve
      while read -r name; do
        deploy_one "$name"
      done < <(replica_names)
    else
      need_replica
      deploy_one "$TARGET"
    fi
    ;;
  metrics) need_replica; exec_in "$(task_of "$TARGET")" fleet-role scrape 9102 ;;
  status) resolve; status ;;
  -h | --help | help) usage ;;
  *) echo "efs-proof fault: unknown fault '$VERB'" >&2; usage ;;
esac
