#!/bin/bash
# gemms_h200 call5, detached: the fused norms' bits first; if they are not stock's, every later step runs
# with SGLANG_CHUNK_ALIGN_NORMS=0 (the log says so). Then fast mode's GPU bits, serving, the profile.
set -u
r=benchmarks/logs/gemms_h200/run.sh
mkdir -p /tmp/runs/gm
OUT=/tmp/runs/gm STEPS=norms NORMS_LIMIT=240 bash $r | tee /tmp/runs/gm/norms-driver.txt
if ! grep -q '^== norm-bits: exit 0' /tmp/runs/gm/norms-driver.txt; then
  echo "== the fused norms did not give stock's bits: the later steps run with SGLANG_CHUNK_ALIGN_NORMS=0"
  export SGLANG_CHUNK_ALIGN_NORMS=0
fi
OUT=/tmp/runs/gm STEPS="bits serving profile" BITS_K=fast BITS_LIMIT=180 SERVING_LIMIT=900 PROFILE_LIMIT=420 bash $r
