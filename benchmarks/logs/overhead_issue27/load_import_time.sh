# The plugin's own load in a fresh interpreter: SGLang's loader entry point (plugin.load) and the
# patch table with every hook module it imports, timed after the standard modules SGLang has
# already imported by then. Median and minimum of 15 processes, bytecode compiled.
#   bash benchmarks/logs/overhead_issue27/load_import_time.sh   (from any directory)
cd "$(dirname "$0")/../../.."
python -m compileall -q sglang_chunk_align >/dev/null
for i in $(seq 15); do
  PYTHONPATH=$PWD python -c "
import dataclasses, functools, logging, math, typing, contextlib, contextvars, wrapt, packaging.version, importlib.metadata, time
t = time.perf_counter()
from sglang_chunk_align.plugin import load
load()
import sglang_chunk_align.patch_table
print(round((time.perf_counter() - t) * 1e6))
"
done | sort -n | awk '{a[NR]=$1} END {print "load() and the patch table, us: median", a[int((NR+1)/2)], "min", a[1]}'
