#!/usr/bin/env bash
# Puts a pair trained on the device (`device_session.sh trainpair`: ckpt.tar.part-* and
# results/ in the run's files_at folder) into vllm_ddtree/checkpoints and its training
# summary and loss plots into evals/results, then shows what changed.
#   scripts/unpack_pair.sh /work/.device/13
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
