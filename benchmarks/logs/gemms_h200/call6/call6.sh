#!/bin/bash
# gemms_h200 call6, detached: the landed norm test (norms.counting_fused) first, then one serving run holding
# stock's GEMM config and norms, the plugin's defaults, fast mode and verify's control side by side.
set -u
r=benchmarks/logs/gemms_h200/run.sh
mkdir -p /tmp/runs/g6
OUT=/tmp/runs/g6 STEPS="norms serving" NORMS_LIMIT=150 SERVING_LIMIT=780 \
  SERVING_SETUPS=plugin-256-stock-ops,plugin-256-defaults,plugin-256-fast,nondet-256-control bash $r
