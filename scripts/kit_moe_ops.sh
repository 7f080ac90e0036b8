#!/usr/bin/env bash
# vLLM's fused-MoE C++ ops (vllm/_moe_C_stable_libtorch.abi3.so), which the offline GPU
# kit leaves out, as extra kit parts: MoE targets (the v2lite_moe setup of
# evals/bench_e2e.py) then run on the kit's machine.
#   usage: scripts/kit_moe_ops.sh [SIZE_MiB]   (default: 63 MiB minus the project tree,
#   which travels with every job, as scripts/split_kit.sh)
# Writes .devkit/moe-part0.. (xz of the library, split) and .devkit/moe.sha256. Carry each
# part in one call, moving it to /root/kit (as the kit's parts), then carry moe.sha256
# with the call that runs `scripts/gpu_suites.sh install`, which installs the library.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.26.0
LIB=vllm/_moe_C_stable_libtorch.abi3.so
cache="${HOME}/.cache/devkit/vllm"
wheel="$(ls "$cache"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$wheel" ]; then
  mkdir -p "$cache"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$cache" "vllm==$VLLM_VERSION"
  wheel="$(ls "$cache"/vllm-"$VLLM_VERSION"-*.whl | head -1)"
fi
tree_bytes="$( (git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null || true) \
  | tail -1 | cut -f1)"
size="${1:-$(( (63 * 1048576 - tree_bytes) / 1048576 ))}"
[ "$size" -ge 4 ] || { echo "the tree ($tree_bytes bytes) leaves no room for a part"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -c "import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))" \
  "$wheel" "$LIB" | xz -9 -T2 > "$tmp/moe.xz"
mkdir -p .devkit
rm -f .devkit/moe-part*
split -b "${size}M" -d -a 1 "$tmp/moe.xz" .devkit/moe-part
(cd "$tmp" && sha256sum moe.xz | cut -d' ' -f1) > .devkit/moe.sha256
echo "MoE ops: $(ls .devkit/moe-part* | wc -l) parts of <= ${size} MiB in .devkit/"
