# Shared by the H200 plans (engine_h200/run.sh, model_families_h200/run.sh): source it after setting
# `out` (where the results go) and `py` (the Python that has SGLang).

record_stack() {  # SUFFIX: the GPU and the versions that ran, into OUT/gpuSUFFIX.txt and OUT/versionsSUFFIX.txt
  nvidia-smi > "$out/gpu$1.txt" 2>&1
  $py -c "import flashinfer, sglang, torch; print('flashinfer', flashinfer.__version__, 'sglang', sglang.__version__, 'torch', torch.__version__)" \
    > "$out/versions$1.txt" 2>&1
}

step() {  # NAME SECONDS COMMAND...: the step's output in OUT/NAME.log; every process it left behind is killed after
  local name=$1 limit=$2; shift 2
  local tag="$name.$$.$RANDOM"
  echo "== $name: start $(date +%T), limit $limit s"
  CA_STEP=$tag timeout -s INT -k 30 "$limit" "$@" > "$out/$name.log" 2>&1
  local code=$?
  echo "== $name: exit $code at $(date +%T)"
  kill_step "$tag"
  tail -n 30 "$out/$name.log"
  return $code
}

kill_step() {  # TAG: TERM, then KILL, every process whose environment holds CA_STEP=TAG. Servers start their own
  # sessions (real_server.py), so a group kill misses them; a command-line pattern (pkill -f) also hits other
  # steps' and other users' processes, and the calling shell where its own text matches.
  local signal pids
  for signal in TERM KILL; do
    pids=$(grep -lzxF "CA_STEP=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
    [[ -z $pids ]] && return 0
    kill -s "$signal" $pids 2>/dev/null
    sleep 3
  done
}

stand_in() {  # Qwen2's, Qwen3's and Llama's MLP import the CuTe DSL, which the H200 machine lacks: the sm90 stand-in gives its answers.
  cp benchmarks/stand_ins/cutedsl_dual_gemm_sm90.py \
    "$($py -c 'import sglang, os; print(os.path.dirname(sglang.__file__))')/kernels/ops/gemm/cutedsl_dual_gemm.py"
}
