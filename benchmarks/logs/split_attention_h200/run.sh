#!/bin/bash
# Issue 32's H200 run, planned whole before the machine was taken: each step in order of
# importance, each under a time limit, every result written into OUT (the device call copies OUT
# back; see COMMANDS.md beside this file).
#
#   1. premise (a) again, now also through the plugin's own SplitPrefill (probe_split_attention.py);
#   2. premise (b): a decoding row in decode steps and as a one-token extend (probe_mixed_decode.py);
#   3. real servers with split attention on, each verified against its stock unchunked reference,
#      radix cache on: GQA 1 at chunk 128 (granite-gqa1), head_dim 256 (gemma-2b, GQA 8) and
#      Granite-3.1-8B's shape (GQA 4), chunk 256.
# The second session's steps (the first run's servers logged no split batch: their workloads
# never mixed tile classes in a batch):
#   4. serving.py's rollouts and agents, split attention (the plugin's defaults) against the same
#      setup with it off (SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION=0, the deferrals before issue 32), side
#      by side, each verified against the recorded unchunked reference and their outputs compared
#      request by request: GQA 1 (granite-gqa1) and Granite-3.1-8B's shape;
#   5. the replay of the schedules scheduled with split attention (benchmarks/schedules_split*.json).
# Those servers logged no split batch either (rollouts' and agents' prompts are long: every piece is
# in the 128-row class), so the third session's steps send verify's tiles workload (short prompts of
# every small tile class beside long ones), at GQA 1 and head_dim 256, chunk 256; then the GQA-1
# serving pair again, the deferrals first, on the machine those servers warmed (step 4 had run the
# split setup first on a cold machine), checked against step 6's recorded reference.
#   6. gqa1-tiles, gemma-tiles, serving-gqa1-again
#
#   usage: OUT=DIR [PY=python3] [STEPS="probes gqa1 gemma granite"] bash benchmarks/logs/split_attention_h200/run.sh
#   second session: STEPS="serving-gqa1 replay serving-granite"
#   third: STEPS="gqa1-tiles serving-gqa1-again gemma-tiles"
# From the repository's root, SGLang 0.5.23 and flashinfer installed.
set -u
out=${OUT:?OUT: where the results go}
py=${PY:-python3}
steps=${STEPS:-probes gqa1 gemma granite}
mkdir -p "$out"
nvidia-smi > "$out/gpu.txt" 2>&1

# step NAME SECONDS COMMAND...: SIGINT at the limit, so the script's own cleanup stops its servers
# and writes its JSON; any server left over is killed before the next step.
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name: start $(date +%T), limit $limit s"
  timeout -s INT -k 30 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $? at $(date +%T)"
  pkill -f "sglang.cli.main" && sleep 5
  tail -n 25 "$out/$name.log"
}
servers() {  # NAME MODEL CHUNK SECONDS: the matrix at one chunk, page 1, radix on, against its reference
  step "$1" "$4" $py benchmarks/real_server.py --model-path "$2" --dummy --phases matrix --chunks "$3" \
    --pages 1 --radix on --prompts 12 --parallel 1 --max-total-tokens 32768 --mem-fraction-static 0.85 \
    --deadline-s $(($4 - 60)) --logs "$out/$1-logs" --out "$out/$1.json"
}
serving() {  # NAME MODEL BASELINES SECONDS KV_TOKENS [SETUPS]: split attention against its deferrals, rollouts and agents
  step "$1" "$4" $py benchmarks/serving.py --model-path "$2" --dummy --setups "${6:-plugin-256-defaults,plugin-256-no-split}" \
    --workloads rl,agent --repeat-setups "" --skip-long-prompts --baselines "$3" --deadline-s $(($4 - 150)) \
    --max-total-tokens "$5" --logs "$out/$1-logs" --out "$out/$1.json"
}
for s in $steps; do
  case $s in
    probes)
      step split-probe 240 $py -m benchmarks.probe_split_attention --json "$out/split_attention.json"
      step mixed-decode-probe 240 $py -m benchmarks.probe_mixed_decode --json "$out/mixed_decode.json";;
    gqa1) servers gqa1-chunk128 benchmarks/models/granite-gqa1 128 420;;
    gemma) servers gemma-chunk256 benchmarks/models/gemma-2b 256 420;;
    granite) servers granite-chunk256 benchmarks/models/granite-3.1-8b 256 420;;
    # KV pools: two servers overlap (one verified while the next starts); GQA 1's KV is 256 KiB a token.
    serving-gqa1) serving serving-gqa1 benchmarks/models/granite-gqa1 benchmarks/logs/split_attention_h200/baselines-gqa1 480 150000;;
    serving-granite) serving serving-granite benchmarks/models/granite-3.1-8b benchmarks/logs/serving_h200_granite 540 250000;;
    gqa1-tiles) servers gqa1-tiles benchmarks/models/granite-gqa1 256 330;;
    gemma-tiles) servers gemma-tiles benchmarks/models/gemma-2b 256 260;;
    serving-gqa1-again)
      mkdir -p "$out/gqa1-baselines"
      cp "$out/gqa1-tiles-logs/baseline-page1.json" "$out/gqa1-baselines/baseline-flashinfer.json"
      serving serving-gqa1-again benchmarks/models/granite-gqa1 "$out/gqa1-baselines" 400 150000 \
        plugin-256-no-split,plugin-256-defaults;;
    replay) step replay 300 $py -m benchmarks.replay_determinism replay --schedules benchmarks/schedules_split.json \
      benchmarks/schedules_chat_split.json --json "$out/results_split.json";;
  esac
done
echo "== all steps ended $(date +%T)"
