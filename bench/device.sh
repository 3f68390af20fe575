#!/bin/bash
# The benchmarks on the H200 device machine (kind nvidia-h200), one parameterised
# script that stages everything it needs from the repository.
#
# Here, once: ../shared/tools/mlx-cuda/pack.sh .gpu (mlx-cuda in two pieces, plus the
# mlx and mlx-lm wheels) and the server's own wheels for Python 3.12 in .whl/ (trio,
# hypercorn, quart, quart-trio, cattrs, llguidance, prometheus-client, httpx and what
# they need: docs/performance.md, "How we measure"); both folders are git-ignored.
#
# A call also carries the tracked files: move bench/results and demo_model out of the
# working tree for the calls (the 64 MiB a call carries; no scenario reads them).
#
#   call 1: bash bench/device.sh stage1
#           carry .gpu/mlxcuda.part.aa .gpu/stage1.sh
#   call 2 (within 30 s), and later calls on the warm machine:
#           bash bench/device.sh SCENARIO[=ARG] ...
#           carry .gpu/mlxcuda.part.ab .gpu/stage2.sh .gpu/mlx-*.whl .gpu/mlx_lm-*.whl .whl
#
# Scenarios (each bounded by its own timeout; a failing one does not stop the rest):
#   agents=SHAPE:S:SESSIONS:TURNS[:SYSTEMS]  bench/agent_sessions.py, ours / mlx_lm.server /
#                                  the bare engine, system prompt of S tokens
#                                  (e.g. qwen3-0.6b:12000:1,4,16:6); AGENTS_SERVER_ARGS: extra
#                                  flags for ours (e.g. '--decode-row-reuse-steps 0'), its
#                                  JSON named with an "-alt" suffix; AGENTS_VARIANTS: more
#                                  configurations of ours, 'NAME[@TREE]=FLAGS' joined by '|'
#                                  (TREE: another build's checkout, e.g. .before, carried;
#                                  FLAGS's leading VARIABLE=VALUE words are its environment),
#                                  alternated with the systems (named in the JSON); AGENTS_ROUNDS: rounds
#                                  (default 1); AGENTS_PROBE=1: each server of ours's engine
#                                  step trace (agent_sessions.py --probe-dir);
#                                  AGENTS_TOOL_SECONDS=LO-HI: a tool's pause between a
#                                  session's turns (--tool-seconds; JSON named "-tools");
#                                  AGENTS_NO_WARM_UP=1: no warm-up pass (saves its time);
#                                  AGENTS_ASK_TOKENS=A: requests ask for max_tokens A, as
#                                  agents do, each stream closed where its reply ends
#                                  (--ask-tokens; JSON named "-ask"); the servers' logs come
#                                  back as agents-server-logs-*.tgz
#   trace=SHAPE:S:SESSIONS[:ARGS]  ours alone, two turns, with its engine process's step
#                                  trace and cProfile (MLX_TRIO_ENGINE_PROBE / _PROFILE)
#   cold=SHAPE:TOKENS[:LEVELS[:SPREAD[:VARIANTS]]]  a cold prompt alone and in a wave of 8 (LEVELS,
#                                  default 1,8): the server's TTFT against the bare engine's
#                                  (bench/engine_overhead.py); SPREAD: each prompt's length
#                                  drawn from TOKENS +- SPREAD (default 0: one length);
#                                  VARIANTS: more servers, 'NAME@TREE:FLAGS' joined by '|'
#                                  (bench/engine_overhead.py --server-variant); the bare engine's
#                                  prompt batch holds at most 64k tokens (eight 16k prompts at
#                                  once ran out of memory); COLD_ARGS: more of its options
#   interleave=SHAPE:TOKENS[:SYSTEMS[:ARGS]]  16 streams while a prompt of TOKENS is
#                                  prefilled (bench/long_prefill.py), ours and mlx_lm.server;
#                                  ARGS: extra flags for ours (e.g. '--decode-stall-factor 0');
#                                  then its steps over 3x the decode step (trace_summary --slow);
#                                  LONG_PREFILL_ARGS: more of its options (e.g. --warm-streams 16);
#                                  INTERLEAVE_VARIANTS: more servers of ours, 'NAME=FLAGS' joined
#                                  by '|' (long_prefill.py --variant: FLAGS's leading
#                                  VARIABLE=VALUE words are its environment), named in SYSTEMS;
#                                  with MLX_TRIO_ENGINE_SLOW_STEP_MS: the slow steps' profiles
#                                  summed (bench/step_profiles.py)
#   lanes=SHAPE:TOKENS[:REPS[:SYSTEMS[:ARGS]]]  decode lanes: bench/decode_lanes.py (16 short
#                                  rows and one of TOKENS, in-process; up to 16k tokens) and
#                                  bench/long_prefill.py with the long prompt decoding 256 tokens,
#                                  ours against --decode-lane-padding 0 (SYSTEMS, default
#                                  ours,lanes-off), REPS rounds alternated (default 2); ARGS: more
#                                  of its options (e.g. '--tree before=DIR' for SYSTEMS
#                                  ours,before: another build's checkout, made here); with
#                                  MLX_TRIO_ENGINE_SLOW_STEP_MS set, the engine's slow steps' cProfile
#                                  (more than 20: bench/step_profiles.py's summary of them instead);
#                                  and the CUDA kernels MLX built in the run, with their times
#   prompt-wave=SHAPE[:PREFIX[:ROWS[:ARGS]]]  bench/prompt_wave.py: ROWS (8) sessions over one
#                                  cached system prompt of PREFIX (12000) tokens starting
#                                  together, in-process, waves of them: each step that
#                                  prefills their user turns (200-500 tokens) taken apart
#                                  (the prefix's copies, the merge, the attention, the rest
#                                  of the prefill, the rows' alignment); ARGS: the server's
#                                  flags for the engine (e.g. '--prefill-attention mlx');
#                                  PROMPT_WAVE_ARGS: more of its options (e.g. --no-sync);
#                                  PROMPT_WAVE_TREE: another build's checkout to run it in
#                                  (e.g. .before, carried)
#   one-client=SHAPE               bench/one_client.py, five alternated reps
#   decode-memory=SHAPE[:ROWS[:TOKENS[:SYSTEMS[:OPTIONS]]]]  bench/decode_memory.py: ROWS (16)
#                                  sequences of TOKENS (12000) decoding, each step's time and
#                                  MLX's memory, in mlx-lm's generator, ours, and a bare KV cache
#                                  (SYSTEMS); OPTIONS: more of its options (e.g. --pipelined)
#   batch-copies[=ROWS[:TOKENS]]  bench/batch_copies.py: a decoding batch's copies as a row
#                                  leaves (its kept rows selected by an index array, or as runs
#                                  of rows concatenated; with the padding trimmed or not) and
#                                  as one joins (mlx-lm's extend), 16 rows of 12000 by default
#   batch-memory[=ROWS[:TOKENS]]  bench/batch_memory.py: what a batch's copies (a join, a
#                                  leave, a growth, an alignment) hold at their peak, evaluated
#                                  at once or a layer at a time; 16 rows of 12,000 tokens
#   cuda-tests[=FILES]             the CUDA-only tests (pytest, no conftest: they build no
#                                  model), tests/test_cuda_masked_decode.py by default
#   held-step=SHAPE[:ROWS[:PREFIX[:OWN]]]  bench/held_prefix_step.py: the model's decode step
#                                  over ROWS (16) rows holding a PREFIX (24000) once and OWN
#                                  (3000) tokens each, against each row holding the prefix
#   shared-prefix[=ROWS[:PREFIX[:OWN[:OPTIONS]]]]  bench/shared_prefix_attention.py: a decode
#                                  step's attention over ROWS (16) rows with a PREFIX (24000)
#                                  held once and OWN (3000) tokens each, against each row
#                                  holding the prefix (grouped, our kernel, MLX's)
#   paced-profile=SHAPE[:TOKENS[:STREAMS]]  bench/paced_step_profile.py under py-spy (native,
#                                  idle included, 25 Hz): 16 streams' decode-only steps, then
#                                  their steps beside a prompt of TOKENS (16000), in-process;
#                                  each phase's ms a step by where it goes. Native sampling
#                                  pauses the process: at 100 Hz the engine ran about 10x
#                                  slower (a 30k prompt's two rounds passed 300 s), so the
#                                  shares say more than the times
#   paced-steps=SHAPE[:TOKENS[:VARIANTS[:ROUNDS]]]  bench/paced_step_profile.py without a
#                                  profiler: 16 streams' decode-only steps, then their steps
#                                  beside a prompt of TOKENS (16000), each VARIANT (default
#                                  default,no-graphs,ops-only; its --variants) in a fresh process,
#                                  ROUNDS (2) alternated; wall time against thread CPU a step
#   resume=SHAPE:S[:REPS]          bench/resume_prefill.py: a retry after a client left mid-prefill
#                                  and a first turn after a restart with --prompt-cache-dir, each
#                                  against cold, a system prompt of S tokens (REPS default 3)
#   chunk-masks[=OPTIONS]          bench/chunk_masks.py: a chunk's attention under mlx-lm's
#                                  array mask and under "causal", times and largest difference
#   chunk-attention[=OPTIONS]      bench/chunk_attention.py: a paced chunk's attention after long
#                                  prefixes, the server's grouped products against other ways
#   row-extract[=OPTIONS]          bench/row_extract.py: a finished row's KV taken out of a
#                                  17-row batch with a step in flight, paddings read back
#                                  from the device or made on the host (OPTIONS: its own)
#   clear-cache=TOKENS[:CHUNK]     bench/clear_cache_cost.py: a paced prefill of TOKENS (chunks
#                                  of CHUNK, default 64) beside 16 decoding sequences, MLX's
#                                  clear_cache as it is and as a no-op (Qwen3-0.6B shape, built
#                                  in-process)
#   paced-step[=PATHS[:OPTIONS]]  bench/paced_step.py: a paced prefill step at 1k-30k depth beside
#                                  16 decoding sequences and alone, by prefill attention path
#                                  (half,float32,cudnn,none) and by pass (one shared by the
#                                  decode and the chunk, or two); OPTIONS: more of its options
#                                  (e.g. '--decoders 16 --chunks 64,256'); Qwen3-0.6B shape,
#                                  built in-process
#   constrained-step=SHAPE[:ROWS[:CONSTRAINED]]  bench/constrained_step.py: the engine's step
#                                  with and without constrained rows, in-process, and where a
#                                  constrained step's time goes (default 64 rows, 16 constrained)
#   first-step=SHAPE               bench/first_step.py: a prompt group's first decode step
#                                  (GenerationBatch.__init__), timed by phase, in waves of 64
#   prefill-first-step=SHAPE[:TOKENS[:ROUNDS]]  bench/prefill_first_step.py: 16 streams and a
#                                  prompt of TOKENS (30000), in-process, its chunk first against
#                                  mlx-lm's order, ROUNDS (3) of each
#   constraints=SHAPE[:profile[:ROUNDS]]  64 clients, a quarter of the requests json_schema-constrained,
#                                  against none (bench/constraints.py); profile: the engine's cProfile too
#   many-clients=SHAPE:MODE:LEVELS the engine ceiling against the server, two alternated rounds
#                                  (bench/engine_overhead.py, every engine's main thread on CPU 3),
#                                  136 +- 64 prompt tokens, 128 new, four requests a client; MODE
#                                  greedy (the default) or sampled (0.7 / 0.9); LEVELS 8,32,64;
#                                  then bench/like_for_like.py's pairs at like host speed;
#                                  MANY_VARIANTS: more servers, 'NAME[@TREE]:FLAGS' joined by '|'
#                                  (bench/engine_overhead.py --server-variant), alternated
#   distributed=SHAPE              kind nvidia-h200-x2: ours and mlx_lm.server on one GPU, then
#                                  ours tensor parallel on both (bench/distributed.py)
# SHAPE: qwen3-0.6b or llama3-8b (random weights, a 32k window: bench/make_shaped_model.py).
# Everything lands in $OUT: the console log and one archive of the JSON results.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/m
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

if [ "${1:-}" = stage1 ]; then
  bash .gpu/stage1.sh
  exit
fi

if [ ! -d /tmp/site/mlx/lib ]; then
  bash .gpu/stage2.sh || exit 1
fi
if [ ! -d /tmp/site/trio ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$here PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH

nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu \
  --format=csv -lms 1000 > "$OUT/smi.csv" 2>&1 &
SMI=$!
trap 'kill $SMI 2> /dev/null' EXIT

step() { echo "== $1 $(date +%T)"; }
# The whole call stays within the device's 600 s: each scenario gets at most its own
# limit and what is left of BUDGET (seconds, default 560) less time to pack the results.
deadline=$((SECONDS + ${BUDGET:-560}))
limit() { local left=$((deadline - SECONDS - 15)); [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }
kernels_built_since() {  # EPOCH FILE: the CUDA kernels MLX built (NVRTC) since EPOCH
  # MLX writes each kernel it builds to its PTX cache when built: times, sizes, names.
  find "${MLX_PTX_CACHE_DIR:-${TMPDIR:-/tmp}/mlx}" -name '*.ptx' -newermt "@$1" \
    -printf '%T@ %s %f\n' 2>/dev/null | sort -n > "$2"
  echo "kernels built during the run: $(wc -l < "$2")"
}
model() {  # the shaped model's directory, built once per warm machine
  local dir=/tmp/m/$1
  if [ ! -f "$dir/config.json" ]; then
    timeout 200 python3 bench/make_shaped_model.py "$1" "$dir" --context 32768 \
      > "$OUT/make-$1.log" 2>&1 || { echo "could not build $1"; tail -5 "$OUT/make-$1.log"; }
  fi
  echo "$dir"
}

for scenario in "$@"; do
  if [ $((deadline - SECONDS)) -lt 45 ]; then echo "== no time left for $scenario"; continue; fi
  name=${scenario%%=*}
  arg=${scenario#*=}
  [ "$arg" = "$scenario" ] && arg=""
  IFS=: read -r shape p1 p2 p3 p4 <<< "$arg"
  step "$scenario"
  case $name in
    agents)
      dir=$(model "$shape")
      extra=()
      IFS='|' read -ra specs <<< "${AGENTS_VARIANTS:-}"
      for spec in "${specs[@]}"; do extra+=(--variant "$spec"); done
      [ -n "${AGENTS_PROBE:-}" ] && extra+=(--probe-dir "$OUT/agents-probe-$SECONDS")
      [ -n "${AGENTS_TOOL_SECONDS:-}" ] && extra+=(--tool-seconds "$AGENTS_TOOL_SECONDS")
      [ -n "${AGENTS_NO_WARM_UP:-}" ] && extra+=(--no-warm-up-pass)
      [ -n "${AGENTS_ASK_TOKENS:-}" ] && extra+=(--ask-tokens "$AGENTS_ASK_TOKENS")
      named=$(printf '%s' "${AGENTS_VARIANTS:-}" | sed 's/[@=][^|]*//g; s/|/-/g')
      timeout -s INT -k 10 "$(limit 540)" python3 bench/agent_sessions.py --model "$dir" \
        --systems "${p4:-ours,mlx_lm,engine}" --system-tokens "$p1" --sessions "${p2:-1,4,16}" \
        --turns "${p3:-6}" --user-tokens 200-500 --max-tokens 64-256 \
        --rounds "${AGENTS_ROUNDS:-1}" --server-args "${AGENTS_SERVER_ARGS:-}" "${extra[@]}" \
        --out "$OUT/agents-$shape-$p1-${p2:-all}${AGENTS_SERVER_ARGS:+-alt}${named:+-$named}${AGENTS_TOOL_SECONDS:+-tools}${AGENTS_ASK_TOKENS:+-ask}.json" \
        2>&1 | grep -v "httpx\|HTTP/1.1" | tail -24
      # Each server's own log (its engine's failures and memory lines), compressed.
      logs=(bench/results/logs/agent-*.log)
      [ -e "${logs[0]}" ] && tar czf "$OUT/agents-server-logs-$SECONDS.tgz" "${logs[@]}" \
        && rm -f "${logs[@]}"
      ;;
    trace)
      # Our engine process's steps (time inside the generator's next()) and its
      # cProfile, for one agent_sessions run of ours (two turns).
      dir=$(model "$shape")
      traced=$OUT/trace-$SECONDS
      mkdir -p "$traced"
      MLX_TRIO_ENGINE_PROBE="$traced/probe" MLX_TRIO_ENGINE_PROFILE="$traced/engine.prof" \
        timeout -s INT -k 10 "$(limit 200)" python3 bench/agent_sessions.py --model "$dir" \
        --systems ours --system-tokens "$p1" --sessions "${p2:-4}" --turns 2 \
        --user-tokens 200-500 --max-tokens 64-256 --rounds 1 --server-args "${p3:-}" \
        --out "$traced/agents.json" 2>&1 | tail -4
      ;;
    cold)
      dir=$(model "$shape")
      variants=()
      IFS='|' read -ra specs <<< "${p4:-}"
      for spec in "${specs[@]}"; do variants+=(--server-variant "$spec"); done
      # mlx-lm prefills a prompt batch under one array mask: eight 16k prompts in one
      # ran an H200 out of memory. The bare engine's batch holds at most 64k prompt
      # tokens here (four of 16k, two of 32k: the server's prompt groups on Qwen3-0.6B).
      concurrency=$(( p1 >= 16000 ? 65536 / p1 : 8 ))
      timeout -s INT -k 10 "$(limit 400)" python3 bench/engine_overhead.py --model "$dir" --systems ceiling --server \
        --levels "${p2:-1,8}" --requests 8 --prompt-tokens "$p1" --prompt-tokens-spread "${p3:-0}" \
        --max-tokens 2 --rounds 1 --no-pickle --trace "$OUT/cold-trace-$p1-${p3:-0}" \
        --prompt-concurrency "$concurrency" "${variants[@]}" ${COLD_ARGS:-} --json-out "$OUT/cold-$shape-$p1-${p3:-0}.json" 2>&1 \
        | tail -12
      ;;
    interleave)
      dir=$(model "$shape")
      # Our engine process's steps too (S lines: tokens, prompts, time in next()).
      probe=$OUT/interleave-probe-$SECONDS
      began=$(date +%s)
      variants=()
      IFS='|' read -ra specs <<< "${INTERLEAVE_VARIANTS:-}"
      for spec in "${specs[@]}"; do variants+=(--variant "$spec"); done
      MLX_TRIO_ENGINE_PROBE="$probe" \
        timeout -s INT -k 10 "$(limit 560)" python3 bench/long_prefill.py --model "$dir" \
        --systems "${p2:-ours,mlx_lm}" --server-args="${p3:-}" "${variants[@]}" \
        --streams 16 --long-tokens "$p1" --stream-tokens 2048 --rounds 1 ${LONG_PREFILL_ARGS:-} \
        --out "$OUT/interleave-$shape-$p1-$SECONDS.json" 2>&1 | tail -6
      # The long prompt's steps over 3x the decode step: wall, CPU, rows, memory.
      for steps in "$probe"-steps.*; do
        [ -f "$steps" ] && python3 bench/trace_summary.py "$steps" --slow 3 2>&1 | head -40
      done
      # With MLX_TRIO_ENGINE_SLOW_STEP_MS set: where the profiled slow steps' host time went.
      if compgen -G "$probe-slow-*" > /dev/null; then
        python3 bench/step_profiles.py "$OUT" --min-total "$((p1 * 9 / 10))" --top 8 2>&1 | head -60
      fi
      # The CUDA kernels MLX built (NVRTC) during the run, with their times: beside the
      # steps' wall-clock times (S lines) they tell a first-use build from other host work.
      kernels_built_since "$began" "$OUT/interleave-ptx-built-$SECONDS.txt"
      ;;
    lanes)
      dir=$(model "$shape")
      if [ "$p1" -le 16000 ]; then  # one batch of 17 rows at 30k runs an H200 out of memory
        timeout -s INT -k 10 "$(limit 150)" python3 bench/decode_lanes.py --model "$dir" --rows 16 \
          --long-tokens "$p1" --lane-padding 32768 --reps 3 \
          --out "$OUT/decode-lanes-$shape-$p1.json" 2>&1 | tail -4
      fi
      began=$(date +%s)
      MLX_TRIO_ENGINE_PROBE="$OUT/lanes-probe-$SECONDS" \
        timeout -s INT -k 10 "$(limit 500)" python3 bench/long_prefill.py --model "$dir" \
        --systems "${p3:-ours,lanes-off}" --variant "lanes-off=--decode-lane-padding 0" --no-stop \
        --streams 16 --long-tokens "$p1" --long-max-tokens 256 --stream-tokens 4000 \
        --rounds "${p2:-2}" ${p4:+$p4} --out "$OUT/lanes-$shape-$p1-$SECONDS.json" 2>&1 | tail -8
      slow_steps=$(find "$OUT" -name 'lanes-probe-*-slow-*' | wc -l)
      echo "slow steps profiled: $slow_steps"
      if [ "$slow_steps" -gt 20 ]; then  # too many to bring back: their summary instead
        python3 bench/step_profiles.py "$OUT" --min-total "$((p1 * 9 / 10))" \
          > "$OUT/step-profiles-$SECONDS.txt" 2>&1
        grep "steps profiled" "$OUT/step-profiles-$SECONDS.txt"
        find "$OUT" -name 'lanes-probe-*-slow-*' -delete
      fi
      for slow in "$OUT"/lanes-probe-*-slow-*; do  # MLX_TRIO_ENGINE_SLOW_STEP_MS
        [ "$slow_steps" -le 20 ] && [ -f "$slow" ] && python3 -c 'import pstats, sys; print(sys.argv[1]);
pstats.Stats(sys.argv[1]).sort_stats("tottime").print_stats(12)' "$slow" 2>&1 | grep -v "^$" | tail -16
      done
      # The kernels' build times beside the slow steps' (S lines, profiles) tell a
      # first-use build from a wait for the device, both of which a profile shows as eval.
      kernels_built_since "$began" "$OUT/lanes-ptx-built-$SECONDS.txt"
      ;;
    paced-profile)
      dir=$(model "$shape")
      prof=$OUT/paced-profile-$shape-${p1:-16000}-$SECONDS
      timeout -s INT -k 10 "$(limit 400)" py-spy record --native --idle -r 25 -f raw -o "$prof.raw" -- \
        python3 bench/paced_step_profile.py --model "$dir" --long-tokens "${p1:-16000}" \
        --streams "${p2:-16}" --decode-steps 200 --rate 25 --json-out "$prof.json" 2>&1 \
        | grep -v "^py-spy>" | tail -14
      # Without the JSON (a run cut short), the warm-up round's shares.
      python3 bench/paced_step_profile.py --summarize "$prof.raw" --top 30 \
        $([ -f "$prof.json" ] && echo --steps "$prof.json" || echo --warm-up) > "$prof.txt" 2>&1
      head -120 "$prof.txt"
      ;;
    paced-steps)
      dir=$(model "$shape")
      timeout -s INT -k 10 "$(limit 500)" python3 bench/paced_step_profile.py --model "$dir" \
        --long-tokens "${p1:-16000}" --decode-steps 200 --variants "${p2:-default,no-graphs,ops-only}" \
        --rounds "${p3:-2}" --json-out "$OUT/paced-steps-$shape-${p1:-16000}-$SECONDS.json" 2>&1 | tail -60
      ;;
    resume)
      dir=$(model "$shape")
      timeout -s INT -k 10 "$(limit 500)" python3 bench/resume_prefill.py --model "$dir" \
        --system-tokens "$p1" --user-tokens 300 --reps "${p2:-3}" \
        --json-out "$OUT/resume-$shape-$p1.json" 2>&1 | tail -8
      ;;
    prompt-wave)
      dir=$(model "$shape")
      # shellcheck disable=SC2086  # the options, split at spaces
      timeout -s INT -k 10 "$(limit 240)" python3 "${PROMPT_WAVE_TREE:-.}/bench/prompt_wave.py" --model "$dir" \
        --prefix "${p1:-12000}" --rows "${p2:-8}" --server-args "${p3:-}" ${PROMPT_WAVE_ARGS:-} \
        --json-out "$OUT/prompt-wave-$shape-${p1:-12000}-${p2:-8}${PROMPT_WAVE_TREE:+-$(basename "$PROMPT_WAVE_TREE")}-$SECONDS.json" 2>&1 | tail -12
      ;;
    one-client)
      dir=$(model "$shape")
      timeout -s INT -k 10 "$(limit 300)" python3 bench/one_client.py --model "$dir" --reps 5 \
        --json-out "$OUT/one-client-$shape.json" 2>&1 | tail -12
      ;;
    decode-memory)
      dir=$(model "$shape")
      # shellcheck disable=SC2086  # the options, split at spaces
      timeout -s INT -k 10 "$(limit 240)" python3 bench/decode_memory.py --model "$dir" \
        --rows "${p1:-16}" --tokens "${p2:-12000}" --steps 40 --systems "${p3:-buffers,engine,ours}" ${p4:-} \
        --out "$OUT/decode-memory-$shape-${p1:-16}-${p2:-12000}.json" 2>&1 | tail -14
      ;;
    batch-copies)
      timeout -s INT -k 10 "$(limit 120)" python3 bench/batch_copies.py --rows "${shape:-16}" \
        --tokens "${p1:-12000}" --out "$OUT/batch-copies-${shape:-16}-${p1:-12000}.json" 2>&1 | tail -8
      ;;
    cuda-tests)
      # shellcheck disable=SC2086  # test files, split at spaces
      timeout -s INT -k 10 "$(limit 180)" python3 -m pytest -q --noconftest \
        -p no:cacheprovider ${arg:-tests/test_cuda_masked_decode.py} 2>&1 | tail -15
      ;;
    held-step)
      dir=$(model "$shape")
      timeout -s INT -k 10 "$(limit 240)" python3 bench/held_prefix_step.py --model "$dir" \
        --rows "${p1:-16}" --prefix "${p2:-24000}" --own "${p3:-3000}" \
        --out "$OUT/held-step-$shape-${p1:-16}-${p2:-24000}-${p3:-3000}.json" 2>&1 | tail -6
      ;;
    shared-prefix)
      # shellcheck disable=SC2086  # more options, split at spaces
      timeout -s INT -k 10 "$(limit 180)" python3 bench/shared_prefix_attention.py \
        --rows "${shape:-16}" --prefix "${p1:-24000}" --own "${p2:-3000}" ${p3:-} \
        --out "$OUT/shared-prefix-${shape:-16}-${p1:-24000}-${p2:-3000}-$SECONDS.json" 2>&1 | tail -8
      ;;
    batch-memory)
      timeout -s INT -k 10 "$(limit 180)" python3 bench/batch_memory.py --rows "${shape:-16}" \
        --tokens "${p1:-12000}" --out "$OUT/batch-memory-${shape:-16}-${p1:-12000}.json" 2>&1 | tail -8
      ;;
    chunk-attention)
      # shellcheck disable=SC2086  # the options, split at spaces
      timeout -s INT -k 10 "$(limit 200)" python3 bench/chunk_attention.py $arg \
        --json-out "$OUT/chunk-attention-$SECONDS.json" 2>&1 | tail -24
      ;;
    chunk-masks)
      # shellcheck disable=SC2086  # the options, split at spaces
      timeout -s INT -k 10 "$(limit 120)" python3 bench/chunk_masks.py $arg \
        --json-out "$OUT/chunk-masks-$SECONDS.json" 2>&1 | tail -12
      ;;
    row-extract)
      # shellcheck disable=SC2086  # shape: its options, split at spaces
      timeout -s INT -k 10 "$(limit 200)" python3 bench/row_extract.py ${shape:-} \
        --json-out "$OUT/row-extract-$SECONDS.json" 2>&1 | tail -20
      ;;
    clear-cache)
      timeout -s INT -k 10 "$(limit 200)" python3 bench/clear_cache_cost.py --long-tokens "$shape" \
        --chunk "${p1:-64}" --reps 3 2>&1 | tail -8
      ;;
    paced-step)
      # shellcheck disable=SC2086  # p1: more options, split at spaces
      timeout -s INT -k 10 "$(limit 300)" python3 bench/paced_step.py \
        --paths "${shape:-half,float32,cudnn,none}" ${p1:-} \
        --json-out "$OUT/paced-step-$SECONDS.json" 2>&1 | tail -100
      ;;
    constrained-step)
      dir=$(model "$shape")
      timeout -s INT -k 10 "$(limit 200)" python3 bench/constrained_step.py --model "$dir" \
        --rows "${p1:-64}" --constrained "${p2:-16}" --reps 5 2>&1 | tail -16
      ;;
    first-step)
      dir=$(model "$shape")
      timeout -s INT -k 10 "$(limit 200)" python3 bench/first_step.py --model "$dir" --waves 4 2>&1 | tail -8
      ;;
    prefill-first-step)
      dir=$(model "$shape")
      timeout -s INT -k 10 "$(limit 240)" python3 bench/prefill_first_step.py --model "$dir" \
        --long-tokens "${p1:-30000}" --rounds "${p2:-3}" \
        --json-out "$OUT/prefill-first-step-$shape.json" 2>&1 | tail -8
      ;;
    constraints)
      dir=$(model "$shape")
      # constraints=SHAPE:profile: with the engine process's cProfile too (both modes
      # in one server: compare the constraint functions' share; it slows the engine)
      profile=""
      [ "${p1:-}" = profile ] && profile="$OUT/constraints-engine.prof"
      MLX_TRIO_ENGINE_PROFILE="$profile" \
        timeout -s INT -k 10 "$(limit 400)" python3 bench/constraints.py --model "$dir" --modes greedy,quarter-constrained \
        --levels 64 --requests 128 --rounds "${p2:-5}" --max-tokens 128 \
        --probe-dir "$OUT/constraints-probe" --json-out "$OUT/constraints-$shape.json" 2>&1 | tail -18
      ;;
    many-clients)
      dir=$(model "$shape")
      sampling=""
      [ "${p1:-greedy}" = sampled ] && sampling="--temperature 0.7 --top-p 0.9"
      variants=()
      IFS='|' read -ra specs <<< "${MANY_VARIANTS:-}"
      for spec in "${specs[@]}"; do variants+=(--server-variant "$spec"); done
      timeout -s INT -k 10 "$(limit 540)" python3 bench/engine_overhead.py --model "$dir" --systems ceiling --server \
        --levels "${p2:-8,32,64}" --rounds 2 --prompt-tokens 136 --prompt-tokens-spread 64 \
        --max-tokens 128 --requests-per-client 4 --engine-cpu 3 $sampling "${variants[@]}" \
        --json-out "$OUT/many-$shape-${p1:-greedy}.json" 2>&1 | sed -n '/^medians/,$p'
      python3 bench/like_for_like.py "$OUT/many-$shape-${p1:-greedy}.json"
      ;;
    distributed)
      dir=$(model "$shape")
      NCCL_NVLS_ENABLE=0 timeout -s INT -k 10 "$(limit 540)" python3 bench/distributed.py --model "$dir" \
        --only single,ref,tp --max-tokens 128 --prompt-tokens 120 --min-requests 4 \
        --requests-per-client 1 --out "$OUT/distributed-$shape" 2>&1 | tail -20
      ;;
    *)
      echo "unknown scenario $name"
      ;;
  esac
done
step done
tar czf "$OUT/results-$(date +%H%M%S).tgz" -C "$OUT" --exclude '*.tgz' . 2> /dev/null
find "$OUT" -mindepth 1 ! -name '*.tgz' -delete
