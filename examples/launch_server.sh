#!/usr/bin/env bash
# Launch SGLang with deterministic flashinfer and small prefill chunks, through the plugin.
#   examples/launch_server.sh                         # the plugin, 256-token chunks, port 30000
#   REFERENCE=1 PORT=30001 examples/launch_server.sh  # stock SGLang, unchunked, radix off: verify's reference
#   sglang-chunk-align verify --server http://127.0.0.1:30000 --reference http://127.0.0.1:30001
# The plugin keeps the radix cache on where its grid rules make it exact (verify expects radix hits);
# SGLANG_CHUNK_ALIGN_RADIX_CACHE=0 keeps stock's behaviour (off), and then verify needs --no-radix.
# Extra arguments go to `sglang serve` (e.g. --tp 2 --mem-fraction-static 0.4), the entry point
# SGLang recommends; every release the plugin supports (0.5.12 to 0.5.23) has it. The default
# model's shape ran on an H200 with this plugin (its config, dummy weights): benchmarks/README.md.
set -euo pipefail
MODEL=${MODEL:-ibm-granite/granite-3.1-8b-instruct}
PORT=${PORT:-30000}
CHUNK=${CHUNK:-256}
if [ "${REFERENCE:-0}" = 1 ]; then
  # Stock SGLang names no plugin of ours (an unset SGLANG_PLUGINS loads every installed plugin).
  # Each prompt alone and whole: no chunks, no radix cache.
  export SGLANG_PLUGINS=none
  set -- --chunked-prefill-size -1 --disable-radix-cache "$@"
else
  # Add chunk_align to SGLANG_PLUGINS (a comma-separated list) unless it is there already.
  PLUGINS=${SGLANG_PLUGINS:-}
  case ",${PLUGINS// /}," in
    *,chunk_align,*) ;;
    *) PLUGINS="${PLUGINS:+$PLUGINS,}chunk_align" ;;
  esac
  export SGLANG_PLUGINS=$PLUGINS
  set -- --chunked-prefill-size "$CHUNK" "$@"
fi
exec sglang serve \
  --model-path "$MODEL" --port "$PORT" \
  --attention-backend flashinfer --enable-deterministic-inference "$@"
