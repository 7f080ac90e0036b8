#!/usr/bin/env bash
# Re-split the GPU kit (.devkit/part0.., from ../shared/devkit/build-kit.sh) into parts
# of SIZE MiB, so that one part plus the project tree fits the 64 MiB a `run` call
# carries (build-kit.sh writes 44 MiB parts; with the tree at 32 MiB they no longer fit).
#   usage: scripts/split_kit.sh [SIZE_MiB]   (default: what fits beside the tree, which a
#   call carries too: 63 MiB minus the tracked and untracked-unignored files, 24 for 38 MB)
# Checks the joined kit against .devkit/kit.sha256 before replacing the parts.
# Fewer calls: nothing on the device reads evals/results (16 MB with its logs; the bench
# writes to $OUT), so `mv evals/results /tmp/` before splitting and the GPU calls (and
# back before any commit) leaves a 25 MB tree and a 163 MB kit in 4 parts of 40 MiB
# (`scripts/split_kit.sh 40`: 40 MiB + the tree fit the 64 MiB a call carries; twenty-second session).
set -euo pipefail
cd "$(dirname "$0")/.."
# du fails on tracked files missing from the work tree (e.g. evals/results moved aside,
# as above): count what exists, which is what a call carries.
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
