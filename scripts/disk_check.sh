#!/usr/bin/env bash
# disk_check.sh NEED_GB WHAT — before a step that writes gigabytes (pip installing torch with its
# CUDA libraries), says how much disk is free for the checkout and for pip's temporary files, and
# warns when less than NEED_GB: pip's "No space left on device" otherwise comes minutes later,
# mid-install, without saying how much was free. A warning, not a refusal: the estimate is rough.
set -euo pipefail
need_gb=$1 what=$2
cd "$(dirname "$0")/.."
# (informational: a path df cannot read gives "?", never a failure)
free_gb() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }' || true; }
here=$(free_gb .)
tmp=$(free_gb "${TMPDIR:-/tmp}")
here=${here:-?} tmp=${tmp:-?}
echo "$what: ${here} GB free for the checkout, ${tmp} GB for temporary files (${TMPDIR:-/tmp}); needs about ${need_gb} GB"
if [ "$here" != "?" ] && awk -v f="$here" -v n="$need_gb" 'BEGIN { exit !(f < n) }'; then
  echo "$what: warning: less than ${need_gb} GB free: pip may stop with 'No space left on device'" >&2
fi
