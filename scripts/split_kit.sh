#!/usr/bin/env bash
# Re-split the GPU kit (.devkit/part0.., from ../shared/devkit/build-kit.sh) into parts
# of SIZE MiB, so that one part plus the project tree fits the 64 MiB a `run` call
# carries (build-kit.sh writes 44 MiB parts; with the tree at 32 MiB they no longer fit).
#   usage: scripts/split_kit.sh [SIZE_MiB]   (default 28)
# Checks the joined kit against .devkit/kit.sha256 before replacing the parts.
set -euo pipefail
size="${1:-28}"
cd "$(dirname "$0")/../.devkit"
n="$(cat parts)"
tmp="$(mktemp kit.XXXXXX)"
trap 'rm -f "$tmp"' EXIT
for ((p = 0; p < n; p++)); do cat "part$p"; done > "$tmp"
echo "$(cat kit.sha256)  $tmp" | sha256sum -c --quiet
rm -f part[0-9]*
split -b "${size}M" -d -a 1 "$tmp" part
ls part[0-9]* | wc -l > parts
echo "kit: $(cat parts) parts of <= ${size} MiB; tree $(cd .. && git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
