#!/bin/bash
# Issue 34's H200 run: the model families RL teams train, each in real servers (benchmarks/real_server.py:
# a stock, unchunked reference with the radix cache off, its cold answers recorded, then the plugin,
# each server checked with `verify` against them: mixed, chat and tiles, 12 requests each, sequential
# and concurrent). Planned whole before the machine was taken: each step under a time limit (SIGINT at
# the limit, so real_server.py stops its servers and keeps its JSON), every result and log written into
# OUT in the step that made it (the device call copies OUT back; COMMANDS.md beside this file).
#
#   qwen3   Qwen3-8B's shape: chunks 128 and 256, radix on (GQA 4, head_dim 128);
#   hybrid  Nemotron-H-8B's shape (Mamba2 + attention): chunks 128, 256 and 512 with the radix switch
#           unset, so the plugin decides and its startup line says why. Mamba2's scan chunks a prefill
#           batch's packed tokens by 256 from the batch's first token: the plugin cuts on those chunks
#           and prefills one request a batch, so it must refuse 128 and serve 256 and 512 exactly; the
#           stock reference's concurrent pass shows what batching does without that. If the reference
#           does not start: Granite-4.0-H-Micro's shape, the same way;
#   probe   benchmarks/probe_mamba2_batching.py: SGLang's Mamba2 scan kernel alone, a request batched
#           after another and chunked, against its solo scan, bit for bit (the hybrid rules' premise);
#   moe     Qwen3-30B-A3B's shape (128 experts, GQA 8): chunk 256, radix on, one model on the GPU at a
#           time (61 GB: the reference stops once its answers are recorded);
#   llama   Llama-3.1-8B's shape: chunks 128 and 256, radix on.
# Qwen3, its MoE and Llama import the CuTe DSL, which the H200 machine lacks: stand_in() puts the sm90
# stand-in over that module (benchmarks/stand_ins/; the real kernel is SM100-only).
#
#   usage: OUT=DIR [PY=python3] [STEPS="qwen3 hybrid moe llama"] [HYBRID_CHUNKS=128,256,512] [HYBRID_LIMIT=420]
#          [MOE_LIMIT=420] bash benchmarks/logs/model_families_h200/run.sh
# From the repository's root, SGLang 0.5.23 and flashinfer installed (.stage/gpu_prelude.sh).
set -u
out=${OUT:?OUT: where the results go}
py=${PY:-python3}
steps=${STEPS:-qwen3 hybrid moe llama}
models=benchmarks/models
mkdir -p "$out"
. benchmarks/logs/gpu_steps.sh
record_stack ""

servers() {  # NAME LIMIT MODEL ARGS...: real_server.py's matrix for one model, page 1, its logs and JSON in OUT
  local name=$1 limit=$2 model=$3; shift 3
  step "$name" "$limit" $py benchmarks/real_server.py --model-path "$models/$model" --dummy --phases matrix --pages 1 \
    --prompts 12 --max-total-tokens 32768 --mem-fraction-static 0.85 --deadline-s $((limit - 90)) \
    --logs "$out/$name-logs" --out "$out/$name.json" "$@"
}
for s in $steps; do
  case $s in
    qwen3) stand_in; servers qwen3-8b 420 qwen3-8b --chunks 128,256 --radix on --parallel 2;;
    hybrid)
      # Mamba state per running request: a bound keeps four servers' pools on one GPU.
      servers nemotron-h-8b ${HYBRID_LIMIT:-420} nemotron-h-8b --chunks ${HYBRID_CHUNKS:-128,256,512} --radix default \
        --parallel 3 -- --max-running-requests 32
      if ! grep -q '"name": "plugin-chunk' "$out/nemotron-h-8b.json" 2>/dev/null; then  # no plugin server came to run
        servers granite-4.0-h-micro 360 granite-4.0-h-micro --chunks 128,256,512 --radix default --parallel 3 \
          -- --max-running-requests 32
      fi;;
    probe) step probe-mamba2 150 $py benchmarks/probe_mamba2_batching.py --out "$out/probe_mamba2.json";;
    moe) stand_in; servers qwen3-30b-a3b ${MOE_LIMIT:-420} qwen3-30b-a3b --chunks 256 --radix on --parallel 1 --one-model-at-a-time;;
    llama) stand_in; servers llama-3.1-8b 390 llama-3.1-8b --chunks 128,256 --radix on --parallel 2;;
  esac
done
echo "== all steps ended $(date +%T)"
