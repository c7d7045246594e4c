#!/bin/bash
# gemms_h200 call8, detached: serving with the sampler warmed (serving.warm_up, 38adc63): stock's GEMM config
# and RMSNorm, timed first as call6 timed them, then the plugin's defaults, then verify's control. Six failed
# starts left this session 764 s of device time: fast mode (timed second in call6 and call7) and fast mode's
# tile test, which call7's 130 s cut, wait for the next session.
set -u
r=benchmarks/logs/gemms_h200/run.sh
mkdir -p /tmp/runs/g8
OUT=/tmp/runs/g8 STEPS=serving SERVING_SETUPS=${SERVING_SETUPS:-plugin-256-stock-ops,plugin-256-defaults,nondet-256-control} \
  SERVING_LIMIT=${SERVING_LIMIT:-620} bash $r
