#!/bin/bash
# gemms_h200 call10, detached (plan from COMMANDS.md, end of call9): the plugin's defaults, the control
# (non-deterministic flashinfer) and fast mode served in one run, so that issue 47's two modes have one
# side-by-side record with a control; then the one fast-mode bits test call9's limit cut (the tile test on
# fp16 down).
set -u
r=benchmarks/logs/gemms_h200/run.sh
mkdir -p /tmp/runs/g10
OUT=/tmp/runs/g10 STEPS=serving SERVING_SETUPS=plugin-256-defaults,nondet-256-control,plugin-256-fast \
  SERVING_LIMIT=${SERVING_LIMIT:-840} bash $r
OUT=/tmp/runs/g10 STEPS=bits BITS_K="tile and not bfloat16 and 18944" BITS_LIMIT=${BITS_LIMIT:-240} bash $r
