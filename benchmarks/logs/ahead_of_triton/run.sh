#!/bin/bash
# Issue 48's GPU runs, planned whole before a machine is taken: per shape, one serving run of the setups the
# issue weighs, side by side on the shape's well-scaled random checkpoint, rollouts and agents, every
# deterministic setup verified against its unchunked reference and verify's control in the run (it must
# fail); serving.json gives each workload's prefill steps and radix-hit tokens, read from its server's log
# ("prefill"). The warm-up samples as the rollouts do (serving.warm_up), so the setup timed first no longer
# compiles SGLang's seeded sampler inside its timed rollouts. GEMMs run SGLang's batch-invariant Triton path:
# sgl-deep-gemm does not load on the machine's torch 2.11, where a full sm90 install uses DeepGEMM.
#
# The flashinfer release is the machine's: `FI=fi074 source .stage/gpu_prelude.sh` (carry .stage/fi074) for
# 0.7.4, whose kernel facts take chunk starts anywhere; on CPU that gave Qwen's rollouts triton's prefill steps
# (benchmarks/README.md, "Prefill steps against triton's"). One shape per session: Qwen's on 0.7.4 took
# 1,015 s on an H100 (qwen2.5-7b-fi074/, COMMANDS.md): the references and the control's kernels 4 min, then
# 2-3 min a setup, the first plugin server's 45 s of GEMM tuning included; its deadline cut chunk 1024.
# Next, each on 0.7.4 (what the README recommends): MODEL=llama-3.2-3b (GQA 3, no record yet; a 3B model
# starts and serves faster, so it suits a session that lost time to failed starts); MODEL=granite-3.1-8b; then
# MODEL=qwen2.5-7b on 0.7.2 (`source .stage/gpu_prelude.sh`, carry .stage/fi072), the release SGLang pins,
# beside 0.7.4's record. LIMIT: the session's device time left at the call, less 400 s (a machine's start took
# about 270 s, and the prelude and the collecting calls need the rest; a start that fails costs 90 s, so check
# the time left after each). On a fresh machine the references and the control's kernels take about 300 s
# before the first setup (275.6 s for Llama-3.2-3B on an H100, llama-3.2-3b-fi074-cut/, whose LIMIT=430 ran
# none): LIMIT needs about 300 s, plus 120 s of --deadline-s margin, more than the setups it should reach.
# Third, issue 48's padded calls (plugin-256-pad: radix hits kept whole, SGLANG_CHUNK_ALIGN_PAD_TILES=1), verified
# like every setup; after the serving run, the split-attention probe with pads (PROBE_LIMIT, 120 s; 0 skips it).
# The control is timed too, so it is the non-deterministic ceiling as well (no second non-deterministic
# server), and it runs second: a run cut short by the limit loses its last setups, never the control
# (call8's limit cut its control, timed last). Then the larger chunks: 1024 first (Qwen's run never reached it,
# and it was Granite's best in the first runs), 512, 1024 with the decode wait (the first runs' Granite
# setting); last, and first cut, triton with the plugin's GEMM configs per M, which tells triton's attention and
# scheduling apart from its GEMMs. A setup starts while 60 s of --deadline-s remain and takes 2-3 min: at Qwen's
# pace LIMIT=1400 would reach the seventh (not yet run).
#
#   usage: OUT=DIR MODEL=NAME [PY=python3] [SETUPS=a,b,...] [LIMIT=1140] [REPLAY_LIMIT=300] [PROBE_LIMIT=120] \
#          bash benchmarks/logs/ahead_of_triton/run.sh
# From the repository's root, SGLang 0.5.23 and flashinfer installed (.stage/gpu_prelude.sh). NAME: a folder
# of benchmarks/models.
set -u
out=${OUT:?OUT: where the results go}
model=${MODEL:?MODEL: a folder of benchmarks/models}
py=${PY:-python3}
limit=${LIMIT:-1140}
mkdir -p "$out"
. benchmarks/logs/gpu_steps.sh
record_stack ""
stand_in
# First, padded calls through fa2 over whole workloads: the CPU's padded schedules for the installed flashinfer
# (benchmarks/README.md, "Padded calls keep radix hits whole"), each replayed as SplitPrefill runs it and again with
# its pads dropped, the control. REPLAY_LIMIT, 300 s (0 skips it); the serving run gets what is left of LIMIT.
started=$(date +%s)
if [ "${REPLAY_LIMIT:-300}" -gt 0 ]; then
  release=fi$($py -c "import flashinfer; print(flashinfer.__version__.replace('.', ''))")
  step replay_pads "${REPLAY_LIMIT:-300}" $py -m benchmarks.replay_determinism replay --schedules \
    "benchmarks/schedules_pad_$release.json" "benchmarks/schedules_chat_pad_$release.json" --json "$out/replay_pads.json"
fi
limit=$(( limit - ($(date +%s) - started) ))
step serving "$limit" $py benchmarks/serving.py --model-path "benchmarks/models/$model" --weights random \
  --checkpoints /tmp/checkpoints \
  --setups "${SETUPS:-plugin-256-defaults,nondet-256-control,plugin-256-pad,triton-256,stock-4096,plugin-1024-defaults,plugin-512-defaults,plugin-1024,triton-256-gemms}" \
  --workloads rl,agent --repeat-setups "" --skip-long-prompts --deadline-s $(( limit - 120 )) \
  --out "$out/serving.json" --logs "$out/serving-logs"
# Padded calls' kernel premise on the installed flashinfer: each member of split attention's probe batches,
# through SplitPrefill with pads, against its solo prefill (the 10-token final piece alone in its class is
# padded at GQA 1 and 4).
[ "${PROBE_LIMIT:-120}" -gt 0 ] && step probe_pads "${PROBE_LIMIT:-120}" $py -m benchmarks.probe_split_attention --json "$out/probe_pads.json"
echo "== all steps ended $(date +%T)"
