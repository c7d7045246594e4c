#!/bin/bash
# Prepare flashinfer for the GPU machine, whose Python (3.12, torch 2.11 cu130,
# nvcc 13.0) has no flashinfer and no network.
#   usage: tests/gpu/stage_flashinfer.sh [DEST] [FLASHINFER_VERSION]
# apache-tvm-ffi 0.1.11 is the version SGLang 0.5.23 pins.
# Writes DEST/fi.tar.xz (flashinfer, pruned of kernel sources the fa2 prefill
# path never compiles, ~14 MB) and the apache-tvm-ffi wheel it imports.
set -euo pipefail
DEST=${1:-.stage}
VER=${2:-0.7.2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST"
python3 -m pip download -q --no-deps -d "$work/w" "flashinfer-python==$VER"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "apache-tvm-ffi==0.1.11"
python3 -m pip install -q --no-deps --no-compile --target "$work/site" "$work"/w/*.whl
# Large kernel families unrelated to attention prefill; import does not need them.
( cd "$work/site/flashinfer/data/csrc" && rm -rf cake_dsv4 cake_sampling kda cake_fmha \
    fused_moe gdn experimental blackwell_bf16_fp4 )
find "$work/site" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$work/site" -cJf "$DEST/fi.tar.xz" .
ls -la "$DEST"
