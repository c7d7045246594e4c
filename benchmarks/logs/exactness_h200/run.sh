#!/bin/bash
# Issue 46's H200 run: exactness where a difference would show. Planned whole before the machine was taken;
# each step under a time limit (SIGINT, so real_server.py stops its servers and keeps its JSON), every
# result and log written into OUT in the step that made it (COMMANDS.md beside this file: the device calls).
#
#   probe    benchmarks/probe_unsplit_decode.py: flashinfer's decode, planned as SGLang's deterministic
#            backend plans it, a request's row at KV 1,000-32,768 in eager batches of 1, 8 and 64 (stock's
#            split plan and the plugin's unsplit one) against its CUDA-graph row alone; and what the
#            unsplit plan costs per eager call;
#   qwen     Qwen2.5-7B's shape on well-scaled random weights (benchmarks/random_checkpoint.py, written on
#            the GPU): a stock unchunked reference, the plugin at chunks 128 and 256 (radix on), and beside
#            each its control, the grid rules off at the same chunk, all checked with verify's defaults
#            (mixed, chat, tiles; 32 requests each, sequential and concurrent); then large-batch: 64
#            prompts of 3,000-3,555 tokens alone and all at once, to the plugin with a decode graph of 8,
#            to the same with SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE=0 (the control), and with
#            --disable-cuda-graph.
# Qwen2's MLP imports the CuTe DSL, which the H200 machine lacks: stand_in() puts the sm90 stand-in over
# that module (benchmarks/stand_ins/). GEMMs run SGLang's batch-invariant Triton path (sgl-deep-gemm does
# not load on the machine's torch 2.11).
#
#   llama    Llama-3.1-8B's shape, the same matrix and controls at chunks 128, 256 and 1024;
#   hybrid   Nemotron-H-8B's (Mamba2 + attention), the radix switch unset, at chunks 256 and 512;
#   engine   the in-process Engine (examples/engine_rollout.py) on Qwen2.5-7B's random checkpoint: a stock
#            unchunked reference records verify_engine's answers; the plugin (chunk 256, radix on) runs
#            the RL cycle and is checked against them; then the control, the plugin with its grid rules
#            off, checked the same way (it must differ).
#
#   usage: OUT=DIR [PY=python3] [STEPS="probe qwen"] [QWEN_LIMIT=900] [QWEN_PHASES=...] [QWEN_CHUNKS=128,256]
#          [LLAMA_LIMIT=700] [LLAMA_CHUNKS=...] [HYBRID_LIMIT=700] [HYBRID_CHUNKS=...] [ENGINE_LIMIT=200]
#          bash benchmarks/logs/exactness_h200/run.sh
# From the repository's root, SGLang 0.5.23 and flashinfer installed (.stage/gpu_prelude.sh).
set -u
out=${OUT:?OUT: where the results go}
py=${PY:-python3}
steps=${STEPS:-probe qwen}
mkdir -p "$out"
. benchmarks/logs/gpu_steps.sh
record_stack ""

servers() {  # NAME LIMIT PHASES CHUNKS RADIX [SERVER ARGS...]: real_server.py on NAME's config, random weights
  local name=$1 limit=$2 phases=$3 chunks=$4 radix=$5; shift 5
  step "$name" "$limit" $py -m benchmarks.real_server --model-path "benchmarks/models/$name" --weights random \
    --checkpoints /tmp/checkpoints --phases "$phases" --chunks "$chunks" --pages 1 --radix "$radix" \
    --parallel 4 --max-total-tokens 65536 --mem-fraction-static 0.85 --deadline-s $((limit - 60)) \
    --logs "$out/$name-logs" --out "$out/$name.json" ${1:+-- "$@"}
  # One file for the folder: a device call returns 8 files at most (call3's fi074 call lost two server logs).
  tar -C "$out" -czf "$out/$name-logs.tgz" "$name-logs" && rm -rf "$out/$name-logs"
}
for s in $steps; do
  case $s in
    probe) step probe-unsplit-decode 300 $py -m benchmarks.probe_unsplit_decode --json "$out/probe_unsplit_decode.json";;
    qwen) stand_in; servers qwen2.5-7b ${QWEN_LIMIT:-900} ${QWEN_PHASES:-matrix,rules-off,large-batch} \
            ${QWEN_CHUNKS:-128,256} on;;
    llama) stand_in; servers llama-3.1-8b ${LLAMA_LIMIT:-700} matrix,rules-off ${LLAMA_CHUNKS:-128,256,1024} on;;
    hybrid) servers nemotron-h-8b ${HYBRID_LIMIT:-700} matrix,rules-off ${HYBRID_CHUNKS:-256,512} default \
              --max-running-requests 32;;
    engine) stand_in
      engine="$py examples/engine_rollout.py --model-path benchmarks/models/qwen2.5-7b --weights random --checkpoints /tmp/checkpoints"
      step engine-reference ${ENGINE_LIMIT:-200} $engine --record-reference "$out/engine-answers.json" \
        --json "$out/engine-reference.json"
      step engine-plugin ${ENGINE_LIMIT:-200} $engine --recorded "$out/engine-answers.json" --json "$out/engine-plugin.json"
      step engine-control ${ENGINE_LIMIT:-200} $engine --control "$out/engine-answers.json" --json "$out/engine-control.json";;
  esac
done
echo "== all steps ended $(date +%T)"
