#!/usr/bin/env bash
# Stand the EFS proof up (or update it): deploy template.yaml and wait for every service.
#
#   deploy/efs-proof/up.sh --image URI --driver-image URI [--stack NAME] [--replicas 2|3|4]
#       [--drain-grace S] [--stop-timeout S] [--model SPEC] [--soak S] [--client-cidr CIDR]
#       [--az NAME] [--arch X86_64|ARM64]
#
# The images are the repository's Dockerfile built twice (the default target and
# --target driver) and pushed where ECS can pull them (README.md shows the commands). Uses the
# AWS CLI's current credentials and region. Running it again with other values updates the stack.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STACK=${EFS_PROOF_STACK:-beyond-fleet-efs-proof}
IMAGE=
DRIVER_IMAGE=
overrides=()

die() {
  echo "efs-proof up: $*" >&2
  exit 1
}

drain=30
stop=45
while [ $# -gt 0 ]; do
  case "$1" in
    --image) IMAGE=${2:?}; shift 2 ;;
    --driver-image) DRIVER_IMAGE=${2:?}; shift 2 ;;
    --stack) STACK=${2:?}; shift 2 ;;
    --replicas) overrides+=("ReplicasPerSlice=${2:?}"); shift 2 ;;
    --drain-grace) drain=${2:?}; shift 2 ;;
    --stop-timeout) stop=${2:?}; shift 2 ;;
    --model) overrides+=("Model=${2:?}"); shift 2 ;;
    --soak) overrides+=("SoakSeconds=${2:?}"); shift 2 ;;
    --client-cidr) overrides+=("AllowedClientCidr=${2:?}"); shift 2 ;;
    --az) overrides+=("AvailabilityZone=${2:?}"); shift 2 ;;
    --arch) overrides+=("CpuArchitecture=${2:?}"); shift 2 ;;
    -h | --help) sed -n '2,11p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ -n "$IMAGE" ] || die "--image is required (the fleet image's URI)"
[ -n "$DRIVER_IMAGE" ] || die "--driver-image is required (the Dockerfile's driver target)"
command -v aws >/dev/null 2>&1 || die "the AWS CLI (aws) is not installed"
if ! [[ "$drain" =~ ^[0-9]+$ && "$stop" =~ ^[0-9]+$ ]]; then
  die "--drain-grace and --stop-timeout are whole seconds"
fi
# A drain that outlives the stop timeout ends in SIGKILL: the ungraceful path the drain avoids.
[ $((drain + 5)) -le "$stop" ] ||
  die "--drain-grace ($drain) must be at least 5 s under --stop-timeout ($stop)"
[ "$stop" -le 120 ] || die "--stop-timeout is capped at 120 s on Fargate"
aws sts get-caller-identity --query Arn --output text >/dev/null ||
  die "the AWS CLI has no working credentials"

echo "deploying stack $STACK (this takes a while: NAT gateway, EFS, services)"
aws cloudformation deploy \
  --template-file "$HERE/template.yaml" \
  --stack-name "$STACK" \
  --capabilities CAPABILITY_IAM CAPABILITY_AUTO_EXPAND \
  --no-fail-on-empty-changeset \
  --parameter-overrides "ImageUri=$IMAGE" "DriverImageUri=$DRIVER_IMAGE" \
  "DrainGraceSeconds=$drain" "StopTimeoutSeconds=$stop" ${overrides[@]+"${overrides[@]}"}

output() {
  aws cloudformation describe-stacks --stack-name "$STACK" \
    --query "Stacks[0].Outputs[?OutputKey=='$1'].OutputValue" --output text
}

cluster=$(output ClusterName)
per_slice=$(output ReplicasPerSlice)
services=("$STACK-edge" "$STACK-control")
for slice in a07 a08; do
  for ((n = 1; n <= per_slice; n++)); do
    services+=("$STACK-$slice-r$n")
  done
done
echo "waiting for ${#services[@]} services to settle"
# describe-services (and so the waiter) takes at most 10 services per call.
for ((i = 0; i < ${#services[@]}; i += 10)); do
  aws ecs wait services-stable --cluster "$cluster" --services "${services[@]:i:10}"
done

aws cloudformation describe-stacks --stack-name "$STACK" --query 'Stacks[0].Outputs' \
  --output table
cat <<EOF

Up. Next:
  deploy/efs-proof/drive.sh --stack $STACK          # matrix + soak, results into results/<run>/
  deploy/efs-proof/fault.sh status                  # (EFS_PROOF_STACK=$STACK)
  deploy/efs-proof/down.sh --stack $STACK           # everything but the results bucket
EOF
