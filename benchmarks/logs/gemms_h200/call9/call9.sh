#!/bin/bash
# gemms_h200 call9, detached (plan from COMMANDS.md, end of call8, cut to its first part by failed starts): the
# split-K probe (written after each shape), then fast mode's GPU bits (its tile test never passed whole). Both
# decide whether fast mode's tiles stay; serving fast mode beside the defaults and the control waits for the
# code that decision leaves (SERVING=1 runs it here too).
set -u
r=benchmarks/logs/gemms_h200/run.sh
mkdir -p /tmp/runs/g9
OUT=/tmp/runs/g9 STEPS=splitk SPLITK_LAYERS="qkv o down" SPLITK_LIMIT=${SPLITK_LIMIT:-240} bash $r
OUT=/tmp/runs/g9 STEPS=bits BITS_K=fast BITS_LIMIT=${BITS_LIMIT:-400} bash $r
[ -n "${SERVING:-}" ] || exit 0
OUT=/tmp/runs/g9 STEPS=serving SERVING_SETUPS=plugin-256-fast,nondet-256-control,plugin-256-defaults \
  SERVING_LIMIT=${SERVING_LIMIT:-840} bash $r
