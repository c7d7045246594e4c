#!/bin/bash
# Issue 33's H200 run, planned whole before the machine was taken: each step under a time limit
# (SIGINT at the limit, so each script stops its Engine or servers and writes its JSON), every
# result and log written into OUT in the step that made it (the device call copies OUT back; see
# COMMANDS.md beside this file).
#
#   engine (flashinfer 0.7.2, the default carry):
#     1. reference: examples/engine_rollout.py --record-reference: a stock Engine (SGLANG_PLUGINS=none),
#        unchunked, radix off, Qwen2.5-7B's shape (dummy weights), policy 0 loaded; verify_engine's
#        cold answers recorded in OUT/reference.json;
#     2. cycle: the same example with the plugin, chunk 256, radix on, memory saver on: policies
#        0, 1, 0, 1 (the replays in reverse order), then verify_engine against OUT/reference.json;
#     3. only if the cycle did not finish (no cycle.json: its Engine did not start, or a memory release
#        failed): the cycle again without the memory saver.
#   cycle: the cycle alone, without the check (no reference recorded on this flashinfer);
#   fi074 (flashinfer 0.7.4: carry .stage/fi074 instead of .stage/fi072, FI=fi074 for the prelude):
#     4. benchmarks/real_server.py: a stock unchunked reference and the plugin at chunks 128 and 256,
#        page 1, radix on, Granite-3.1-8B's shape, each verified (mixed, chat, tiles).
#
#   usage: OUT=DIR [PY=python3] STEPS="engine" | STEPS="cycle fi074" bash benchmarks/logs/engine_h200/run.sh
# From the repository's root, SGLang 0.5.23 and flashinfer installed (.stage/gpu_prelude.sh).
set -u
out=${OUT:?OUT: where the results go}
py=${PY:-python3}
steps=${STEPS:-engine}
mkdir -p "$out"
tag=${steps// /_}
. benchmarks/logs/gpu_steps.sh
record_stack "_$tag"

qwen=benchmarks/models/qwen2.5-7b
for s in $steps; do
  case $s in
    engine)
      stand_in
      step reference 400 $py examples/engine_rollout.py --model-path $qwen --dummy \
        --record-reference "$out/reference.json" --json "$out/reference_run.json"
      step cycle 420 $py examples/engine_rollout.py --model-path $qwen --dummy \
        --recorded "$out/reference.json" --json "$out/cycle.json"
      if [ ! -s "$out/cycle.json" ]; then  # it never finished (its JSON is written at the end)
        step cycle-no-memory-saver 360 $py examples/engine_rollout.py --model-path $qwen --dummy --no-memory-saver \
          --recorded "$out/reference.json" --json "$out/cycle_no_memory_saver.json"
      fi;;
    cycle)  # the cycle alone, with no reference (on a flashinfer release other than the reference's)
      stand_in
      step cycle-alone 300 $py examples/engine_rollout.py --model-path $qwen --dummy --json "$out/cycle_alone.json";;
    fi074)
      step fi074-granite 480 $py benchmarks/real_server.py --model-path benchmarks/models/granite-3.1-8b --dummy \
        --phases matrix --chunks 128,256 --pages 1 --radix on --prompts 12 --parallel 2 \
        --max-total-tokens 32768 --mem-fraction-static 0.85 --deadline-s 360 \
        --logs "$out/fi074-logs" --out "$out/fi074_granite.json";;
  esac
done
echo "== all steps ended $(date +%T)"
