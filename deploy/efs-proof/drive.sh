#!/usr/bin/env bash
# Run the proof: start the driver task inside the VPC, wait for it, fetch its results.
#
#   deploy/efs-proof/drive.sh [--stack NAME] [--run ID] [--soak S] [--matrix-args "ARGS"]
#       [--timeout S] [--no-wait]
#
# The driver (fleet-role driver, in the image's driver target) writes a state file for the
# fleet, runs `fleet-sim matrix --substrate attached` with fault.sh as its fault command, then a
# soak, and copies results/<run>/ to the stack's results bucket. This script then copies that to
# deploy/efs-proof/results/<run>/, adds stack.json (the stack's parameters and outputs) and the
# driver's exit to run.txt (see results/README.md). Exit status: the driver's.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STACK=${EFS_PROOF_STACK:-beyond-fleet-efs-proof}
RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)
SOAK=
MATRIX_ARGS=
TIMEOUT_S=21600
WAIT=1

die() {
  echo "efs-proof drive: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case "$1" in
    --stack) STACK=${2:?}; shift 2 ;;
    --run) RUN_ID=${2:?}; shift 2 ;;
    --soak) SOAK=${2:?}; shift 2 ;;
    --matrix-args) MATRIX_ARGS=${2:?}; shift 2 ;;
    --timeout) TIMEOUT_S=${2:?}; shift 2 ;;
    --no-wait) WAIT=0; shift ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ "$RUN_ID" =~ ^[A-Za-z0-9._-]+$ ]] || die "--run must be letters, digits, '.', '_' or '-'"
[[ -z "$SOAK" || "$SOAK" =~ ^[0-9]+$ ]] || die "--soak is whole seconds"
[[ "$TIMEOUT_S" =~ ^[0-9]+$ ]] || die "--timeout is whole seconds"
[[ "$MATRIX_ARGS" =~ ^[A-Za-z0-9\ ._=-]*$ ]] || die "--matrix-args holds flags and plain values only"
command -v aws >/dev/null 2>&1 || die "the AWS CLI (aws) is not installed"

output() {
  aws cloudformation describe-stacks --stack-name "$STACK" \
    --query "Stacks[0].Outputs[?OutputKey=='$1'].OutputValue" --output text
}

cluster=$(output ClusterName) || die "cannot read stack $STACK (is it up?)"
task_definition=$(output DriverTaskDefinition)
subnet=$(output AppSubnet)
group=$(output FleetSecurityGroup)
bucket=$(output ResultsBucket)

environment="{\"name\":\"FLEET_RUN_ID\",\"value\":\"$RUN_ID\"}"
if [ -n "$SOAK" ]; then
  environment+=",{\"name\":\"FLEET_SOAK_S\",\"value\":\"$SOAK\"}"
fi
if [ -n "$MATRIX_ARGS" ]; then
  environment+=",{\"name\":\"FLEET_MATRIX_ARGS\",\"value\":\"$MATRIX_ARGS\"}"
fi
overrides="{\"containerOverrides\":[{\"name\":\"driver\",\"environment\":[$environment]}]}"

task=$(aws ecs run-task --cluster "$cluster" --task-definition "$task_definition" \
  --launch-type FARGATE --enable-execute-command \
  --network-configuration "awsvpcConfiguration={subnets=[$subnet],securityGroups=[$group],assignPublicIp=DISABLED}" \
  --overrides "$overrides" --query 'tasks[0].taskArn' --output text)
if [ -z "$task" ] || [ "$task" = None ]; then
  die "run-task started nothing (see the AWS CLI's message)"
fi
echo "run $RUN_ID: driver task $task"
echo "  its log: aws logs tail $(output DriverLogGroup) --follow"
[ "$WAIT" = 1 ] || exit 0

# Polled rather than `aws ecs wait tasks-stopped`, whose ten minutes a soak outlasts.
started=$SECONDS
while :; do
  status=$(aws ecs describe-tasks --cluster "$cluster" --tasks "$task" \
    --query 'tasks[0].lastStatus' --output text)
  [ "$status" != STOPPED ] || break
  if [ $((SECONDS - started)) -ge "$TIMEOUT_S" ]; then
    die "the driver is still $status after ${TIMEOUT_S}s; it keeps running (task $task)"
  fi
  sleep 30
done
code=$(aws ecs describe-tasks --cluster "$cluster" --tasks "$task" \
  --query 'tasks[0].containers[0].exitCode' --output text)
reason=$(aws ecs describe-tasks --cluster "$cluster" --tasks "$task" \
  --query 'tasks[0].stoppedReason' --output text)
echo "driver stopped after $((SECONDS - started))s: exit $code ($reason)"

destination="$HERE/results/$RUN_ID"
mkdir -p "$destination"
aws s3 cp --recursive --only-show-errors "s3://$bucket/results/$RUN_ID" "$destination"
# What the fleet was: the stack's parameters (images, replica count, drain grace) and outputs.
aws cloudformation describe-stacks --stack-name "$STACK" \
  --query 'Stacks[0].{parameters: Parameters, outputs: Outputs}' --output json \
  >"$destination/stack.json"
echo "driver: exit $code ($reason), task $task" >>"$destination/run.txt"
echo "results: $destination"
[[ "$code" =~ ^[0-9]+$ ]] || exit 1
exit "$code"
