#!/usr/bin/env bash
# Take the EFS proof down: delete the stack and wait until it is gone.
#
#   deploy/efs-proof/down.sh [--stack NAME] [--purge-results]
#
# The results bucket is kept (the stack retains it) so a run's record outlives its fleet;
# --purge-results empties and deletes it too. Copy results out first: drive.sh already does.
# Safe to run again: a stack that does not exist is reported and skipped.
set -euo pipefail

STACK=${EFS_PROOF_STACK:-beyond-fleet-efs-proof}
PURGE=0

die() {
  echo "efs-proof down: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case "$1" in
    --stack) STACK=${2:?}; shift 2 ;;
    --purge-results) PURGE=1; shift ;;
    -h | --help) sed -n '2,8p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

command -v aws >/dev/null 2>&1 || die "the AWS CLI (aws) is not installed"

if ! aws cloudformation describe-stacks --stack-name "$STACK" >/dev/null 2>&1; then
  echo "stack $STACK does not exist; nothing to delete (a results bucket it left is named in its"
  echo "last up.sh output, and goes with: aws s3 rb s3://BUCKET --force)"
  exit 0
fi
bucket=$(aws cloudformation describe-stacks --stack-name "$STACK" \
  --query "Stacks[0].Outputs[?OutputKey=='ResultsBucket'].OutputValue" --output text)

echo "deleting stack $STACK"
aws cloudformation delete-stack --stack-name "$STACK"
aws cloudformation wait stack-delete-complete --stack-name "$STACK"
echo "stack $STACK deleted"

if [ -n "$bucket" ] && [ "$bucket" != None ]; then
  if [ "$PURGE" = 1 ]; then
    aws s3 rm "s3://$bucket" --recursive --only-show-errors
    aws s3 rb "s3://$bucket"
    echo "results bucket $bucket deleted"
  else
    echo "results bucket $bucket kept (down.sh --purge-results deletes it)"
  fi
fi
