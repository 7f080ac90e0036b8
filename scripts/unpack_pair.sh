#!/usr/bin/env bash
# Puts a pair trained by `scripts/gpu_suites.sh trainpair` (or trainyarn) into
# vllm_ddtree/checkpoints, and its training summary and loss plots into evals/results,
# then shows what changed. FOLDER holds the stage's ckpt.tar.part-* and results/ (the
# stage's log folder, or a copy of it fetched from the GPU machine).
#   scripts/unpack_pair.sh /tmp/gpu-suites
set -euo pipefail
src="${1:?usage: scripts/unpack_pair.sh <folder with ckpt.tar.part-*>}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
cat "$src"/ckpt.tar.part-* | tar xf - -C "$tmp"
for d in target drafter; do
  [ -f "$tmp/$d/model.safetensors" ] || { echo "no $d checkpoint in $src" >&2; exit 1; }
  cp "$tmp/$d"/* "$repo/vllm_ddtree/checkpoints/$d/"
done
if [ -d "$src/results" ]; then
  cp "$src"/results/train_pair.json "$src"/results/train_*_loss.png "$repo/evals/results/" \
    2>/dev/null || true
fi
rm -rf "$tmp"
git -C "$repo" status --short vllm_ddtree/checkpoints evals/results
