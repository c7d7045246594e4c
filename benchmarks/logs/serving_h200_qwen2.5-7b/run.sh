#!/bin/bash
# Issue 31's second H200 run, planned whole before the machine was taken: each step in order of
# importance, each under a time limit, every result written into OUT (the device call copies OUT
# back while the run goes on; see COMMANDS.md beside this file).
#
#   1. serving.py on Qwen2.5-7B's shape (GQA 7, head_dim 128): the plugin's defaults, stock
#      deterministic flashinfer, deterministic triton and non-deterministic flashinfer, on
#      rollouts and agents, each deterministic setup verified against its unchunked reference;
#   2. profile_determinism.py on the same shape: one decode step of 64 requests with 2k tokens of
#      context, and one 256-token chunk over 2k cached tokens, the plugin against
#      non-deterministic flashinfer and deterministic triton;
#   3. serving.py on Granite-3.1-8B's shape: the plugin's defaults beside non-deterministic
#      flashinfer (the one setup of the first run the deadline cut), the defaults verified
#      against the first run's recorded references.
#
#   usage: OUT=DIR [PY=python3] bash benchmarks/logs/serving_h200_qwen2.5-7b/run.sh
# From the repository's root, SGLang 0.5.23 and flashinfer installed.
set -u
out=${OUT:?OUT: where the results go}
py=${PY:-python3}
mkdir -p "$out"
nvidia-smi > "$out/gpu.txt" 2>&1
# Qwen2's MLP builds DualGemm, whose module imports the CuTe DSL at its top; its kernel is SM100-only.
module=$($py -c "import os, sglang; print(os.path.join(os.path.dirname(sglang.__file__), 'kernels/ops/gemm/cutedsl_dual_gemm.py'))")
[ -n "${DRY:-}" ] || cp benchmarks/stand_ins/cutedsl_dual_gemm_sm90.py "$module" || exit 1
echo "CuTe DSL stand-in copied over $module" > "$out/stand_in.txt"

# step NAME SECONDS COMMAND...: SIGINT at the limit, so the script's own cleanup stops its servers
# and writes its JSON; any server left over is killed before the next step.
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name: start $(date +%T), limit $limit s"
  timeout -s INT -k 30 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $? at $(date +%T)"
  pkill -f "sglang.cli.main" && sleep 5
  tail -n 40 "$out/$name.log"
}
qwen=benchmarks/models/qwen2.5-7b
granite=benchmarks/models/granite-3.1-8b
step qwen-serving 840 $py benchmarks/serving.py --model-path $qwen --dummy \
  --setups plugin-256-defaults,stock-4096,triton-256,nondet-256 --workloads rl,agent --repeat-setups "" \
  --skip-long-prompts --deadline-s 660 --out "$out/qwen-serving.json" --logs "$out/qwen-logs"
step qwen-profile 330 $py benchmarks/profile_determinism.py --model-path $qwen --dummy \
  --setups plugin-256-defaults,nondet-256,triton-256 --out "$out/qwen-profile.json" --logs "$out/qwen-profile-logs"
step granite-serving 300 $py benchmarks/serving.py --model-path $granite --dummy \
  --setups plugin-256-defaults,nondet-256 --workloads rl,agent --repeat-setups "" --skip-long-prompts \
  --baselines benchmarks/logs/serving_h200_granite --out "$out/granite-serving.json" --logs "$out/granite-logs"
echo "== all steps ended $(date +%T)"
