#!/usr/bin/env bash
# Re-split the offline vLLM kit (.devkit/part0.., .devkit/parts, .devkit/kit.sha256) into
# parts of SIZE MiB, for a GPU machine that receives the project tree and one kit part
# per job within a size limit (64 MiB here).
#   usage: scripts/split_kit.sh [SIZE_MiB]   (default: 63 MiB minus the files of the tree,
#   tracked and untracked-unignored, which travel with every job)
# Checks the joined kit against .devkit/kit.sha256 before replacing the parts.
set -euo pipefail
cd "$(dirname "$0")/.."
# Count the files that exist (du fails on tracked files missing from the work tree).
tree_bytes="$( (git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null || true) \
  | tail -1 | cut -f1)"
size="${1:-$(( (63 * 1048576 - tree_bytes) / 1048576 ))}"
[ "$size" -ge 4 ] || { echo "the tree ($tree_bytes bytes) leaves no room for a kit part"; exit 1; }
cd .devkit
n="$(cat parts)"
tmp="$(mktemp kit.XXXXXX)"
trap 'rm -f "$tmp"' EXIT
for ((p = 0; p < n; p++)); do cat "part$p"; done > "$tmp"
echo "$(cat kit.sha256)  $tmp" | sha256sum -c --quiet
rm -f part[0-9]*
split -b "${size}M" -d -a 1 "$tmp" part
ls part[0-9]* | wc -l > parts
echo "kit: $(cat parts) parts of <= ${size} MiB; tree $tree_bytes bytes"
