#!/bin/bash
# Issue 47's H200 run, planned whole before the machine is taken: each step in order of importance, under a
# time limit (SIGINT, so each script stops its servers and writes its JSON), every result and log written
# into OUT in the step that made it. GEMMs run SGLang's batch-invariant Triton path: sgl-deep-gemm does not
# load on the machine's torch 2.11, where a full SGLang 0.5.23 install on sm90 sends bf16 GEMMs to DeepGEMM.
#
#   bits     tests/gpu/test_gemm_bits.py: every config the plugin may tune against stock's bits at M 1-4,096
#            on Qwen2.5-7B's qkv and down, bf16 and fp16; controls that must differ: K summed in reverse
#            on every shape, cuBLAS on some; fast mode's split-K batch-invariant, a split chosen by M its
#            control (BITS_K: pytest's -k, to run some of its tests);
#   norms    tests/gpu/test_norm_bits.py: RMSNorm with a residual through the plugin's three kernels against
#            stock's forward_native under batch-invariant mode, bf16 and fp16, five hidden sizes, M 1-4,096;
#            the control, each row's squares summed in reverse, must differ;
#   micro    benchmarks/gemm_configs.py: every GEMM of six model families, 27 configs each against stock's
#            bits at M up to 16,384, the plugin's tuner, and stock/tuned/cuBLAS times at M up to 256;
#   splitk   benchmarks/probe_split_k.py: fast mode's kernel (split_k.py) at 1, 2, 4 and 8 splits on
#            Qwen2.5-7B's GEMMs (SPLITK_LAYERS: some of them), batch invariance, bits, time against the
#            tuned configs and cuBLAS, and fast mode as a server runs it with the tiles split_tiles keeps;
#   profile  benchmarks/profile_determinism.py on Qwen2.5-7B's random checkpoint: one decode step of 64
#            requests with 2k tokens of context, the plugin's defaults (GEMM configs per M, on by default
#            since call2) and with fast GEMMs, beside non-deterministic flashinfer, one server at a time;
#   serving  benchmarks/serving.py on the same checkpoint, rollouts and agents: the same three setups, each
#            deterministic one verified (fast GEMMs against a reference that runs them, unchunked); the
#            non-deterministic one is verify's control (it must find it inexact; call2 had none), timed second
#            so that a limit cuts a timed setup first (call8's cut its control, timed last).
# call1-call4 ran the plan as it was before fast mode (COMMANDS.md gives each call's command).
#
#   usage: OUT=DIR [PY=python3] [STEPS="bits norms micro splitk profile serving"] [MICRO_MODELS="qwen2.5-7b ..."]
#          [BITS_K=EXPRESSION] [SERVING_SETUPS=a,b,...] [PROFILE_SETUPS=a,b,...] [SPLITK_LAYERS="qkv o down"] [BITS_LIMIT=420 NORMS_LIMIT=240 MICRO_LIMIT=900 SPLITK_LIMIT=300 PROFILE_LIMIT=480 SERVING_LIMIT=840]
#          (seconds)
#          bash benchmarks/logs/gemms_h200/run.sh
# From the repository's root, SGLang 0.5.23 and flashinfer installed (.stage/gpu_prelude.sh). Planned
# durations (a warm machine; the first compiles of SGLang's kernel with each config dominate bits and micro):
# bits about 2 min (call4), micro about 5 min, splitk about 2 min (call1), profile about 5.5 min (three servers in
# turn, call2), serving about 11.5 min (three setups and two references, call2) plus about 2 for the control.
# A cold machine's start cost about 30 s in call2, 450 s on 2026-12-05 (exactness_h200/COMMANDS.md, call3). Fast
# mode's and the norms' session: STEPS="bits norms serving profile" BITS_K=fast (about 21 min). Fast mode's
# tiles (gemms.split_tiles) outgrew call7's limits (COMMANDS.md): splitk on qkv, o and down over 120 s, bits
# -k fast over 130 s (compiling every tile), serving two setups, two references and the control over 700 s.
set -u
out=${OUT:?OUT: where the results go}
py=${PY:-python3}
steps=${STEPS:-bits norms micro splitk profile serving}
qwen=benchmarks/models/qwen2.5-7b
weights="--weights random --checkpoints /tmp/checkpoints"
mkdir -p "$out"
. benchmarks/logs/gpu_steps.sh
record_stack ""
for s in $steps; do
  case $s in
    bits) step gemm-bits ${BITS_LIMIT:-420} $py -m pytest -q -n 0 -rs -s ${BITS_K:+-k "$BITS_K"} tests/gpu/test_gemm_bits.py;;
    norms) step norm-bits ${NORMS_LIMIT:-240} $py -m pytest -q -n 0 -rs -s tests/gpu/test_norm_bits.py;;
    micro) step gemm-configs ${MICRO_LIMIT:-900} $py -m benchmarks.gemm_configs ${MICRO_MODELS:+--models $MICRO_MODELS} \
             --json "$out/gemm_configs.json";;
    splitk) step probe-split-k ${SPLITK_LIMIT:-300} $py -m benchmarks.probe_split_k ${SPLITK_LAYERS:+--layers $SPLITK_LAYERS} \
              --json "$out/probe_split_k.json";;
    profile) stand_in; step profile ${PROFILE_LIMIT:-480} $py benchmarks/profile_determinism.py --model-path $qwen $weights \
               --setups ${PROFILE_SETUPS:-plugin-256-defaults,plugin-256-fast,nondet-256} --out "$out/profile.json" \
               --logs "$out/profile-logs";;
    serving) stand_in; step serving ${SERVING_LIMIT:-840} $py benchmarks/serving.py --model-path $qwen $weights \
               --setups ${SERVING_SETUPS:-plugin-256-defaults,nondet-256-control,plugin-256-fast} \
               --workloads rl,agent --repeat-setups "" --skip-long-prompts --deadline-s 700 \
               --out "$out/serving.json" --logs "$out/serving-logs";;
  esac
done
echo "== all steps ended $(date +%T)"
