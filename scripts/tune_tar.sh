#!/usr/bin/env bash
# A tuning tree for scripts/device_run.sh that carries only what differs: `scripts/tune_tar.sh NAME COMMIT
# [PATH=REV ...]` writes .tune-src/NAME.tar (COMMIT's files that differ from the working tree's HEAD, then each
# PATH as it is at REV, and a .device_commit naming them) and .tune-src/NAME.deleted (HEAD's files that COMMIT
# lacks). device_run.sh lays them over a copy of the carried tree for TUNING="NAME:...". Carry .tune-src with the
# call: a whole second tree beside .whl can pass the device tool's 64 MiB limit on what travels.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 NAME COMMIT [PATH=REV ...]" >&2; exit 2; }
name=$1 commit=$2; shift 2
cd "$(dirname "$0")/.."
git diff --quiet HEAD -- . ':!results' || { echo "commit or stash the working tree's changes first" >&2; exit 1; }
mkdir -p .tune-src
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
changed=$(git diff --name-only --diff-filter=AMRT HEAD "$commit" -- . ':!results')
[ -n "$changed" ] && git archive "$commit" $changed | tar -x -C "$stage"
git diff --name-only --diff-filter=D HEAD "$commit" -- . ':!results' > ".tune-src/$name.deleted"
label=$(git rev-parse --short "$commit")
for spec in "$@"; do  # PATH=REV: that file as it is at REV
  path=${spec%%=*} rev=${spec#*=}
  mkdir -p "$stage/$(dirname "$path")" && git show "$rev:$path" > "$stage/$path"
  label="$label+$path@$(git rev-parse --short "$rev")"
done
echo "$label" > "$stage/.device_commit"
tar -c -f ".tune-src/$name.tar" -C "$stage" .
echo ".tune-src/$name.tar: $(tar -tf ".tune-src/$name.tar" | grep -vc '/$') files ($label)"
