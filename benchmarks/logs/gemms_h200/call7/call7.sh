#!/bin/bash
# gemms_h200 call7, detached: fast mode with one program per tile where that is faster (gemms.split_tiles).
# The split-K probe on Qwen2.5-7B's three split GEMMs (each split's batch invariance and bits, the split-by-M
# control, the tiles split_tiles keeps, fast mode's time at M 1-256 against the per-M configs and cuBLAS), fast
# mode's GPU bits (every tile it may use, batch invariance, the control), then serving: the defaults, fast mode
# (its tiles chosen at startup) and verify's control side by side.
set -u
r=benchmarks/logs/gemms_h200/run.sh
mkdir -p /tmp/runs/g7
OUT=/tmp/runs/g7 STEPS="splitk bits serving" SPLITK_LAYERS="qkv o down" SPLITK_LIMIT=120 BITS_K=fast BITS_LIMIT=130 \
  SERVING_SETUPS=plugin-256-defaults,plugin-256-fast,nondet-256-control SERVING_LIMIT=700 bash $r
