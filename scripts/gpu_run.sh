#!/usr/bin/env bash
# Runs on the GPU machine (no network): install carried wheels, build kforge, then the given steps.
#   scripts/gpu_run.sh test [pytest args...]   full GPU suite, log in $OUT/pytest.log
#                                                (add --shard I/N to run the I-th of N parts)
#   scripts/gpu_run.sh bench <args...>         python -m kforge.bench <args>, log in $OUT/bench-*.log
#   scripts/gpu_run.sh suite [SECONDS] [args]  the whole GPU suite, one shard per GPU, all at once
#                                                (logs $OUT/shardI.log; counts per shard even when a
#                                                shard is cut at SECONDS, default 480; each test's
#                                                seconds in $OUT/durationsI.txt: concatenated, they
#                                                are tests/gpu_durations.txt, which orders the suite
#                                                longest first)
#   scripts/gpu_run.sh sh '<command>'          anything else after the build
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# A warm machine keeps its build between calls: rebuild when the C++ sources differ from the ones
# built (kernels_src/ needs no build: NVRTC compiles it at run time).
src_hash=$(cat setup.py CMakeLists.txt $(find src -type f | sort) 2>/dev/null | sha1sum | cut -c1-40)
if [ "$(cat /tmp/kforge-built 2>/dev/null)" != "$src_hash" ]; then
  t0=$(date +%s)
  # No network there: build in place with setup.py (no pip, no build isolation).
  MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  echo "$src_hash" > /tmp/kforge-built
fi
export PYTHONPATH=$PWD/python:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, thunder; print('torch', torch.__version__, 'thunder', thunder.__version__)" 2>&1 | grep -v transformer_engine
rc=0
while [ $# -gt 0 ]; do
  step=$1; shift
  case "$step" in
    test)
      args=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      python3 -m pytest -q -ra -p no:cacheprovider "${args[@]:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -60
      rc=$(( rc | ${PIPESTATUS[0]} ));;
    bench)
      args=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      python3 -m kforge.bench "${args[@]}" 2>&1 | tee "$OUT/bench-${args[0]}.log" | tail -40
      rc=$(( rc | ${PIPESTATUS[0]} ));;
    suite)
      # One pytest per GPU, each on its own shard with -v, so that a shard its time limit cuts still
      # names every result it reached (the summary line comes only at the end).
      limit=480; if [[ "${1:-}" =~ ^[0-9]+$ ]]; then limit=$1; shift; fi
      args=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      gpus=$(nvidia-smi -L | wc -l); workers=$(( $(nproc) / gpus - 1 )); [ "$workers" -ge 1 ] || workers=1
      for i in $(seq 1 "$gpus"); do
        CUDA_VISIBLE_DEVICES=$(( i - 1 )) TEST_DURATIONS_FILE="$OUT/durations$i.txt" \
          timeout "$limit" python3 -m pytest -v -p no:cacheprovider tests \
          -n "$workers" --dist loadgroup -rf -W ignore --tb=short -p no:logging --shard "$i/$gpus" \
          "${args[@]}" > "$OUT/shard$i.log" 2>&1 &
      done
      wait
      for i in $(seq 1 "$gpus"); do
        f=$OUT/shard$i.log
        echo "shard $i/$gpus: $(grep -cE '^\[gw[0-9]+\].* PASSED ' "$f") passed," \
             "$(grep -cE '^\[gw[0-9]+\].* FAILED ' "$f") failed, $(grep -cE '^\[gw[0-9]+\].* SKIPPED ' "$f") skipped," \
             "$(grep -cE '^\[gw[0-9]+\].* ERROR ' "$f") errors; last: $(grep -E '^\[gw[0-9]+\] \[' "$f" | tail -1 | cut -c1-60)"
        grep -qE '^=+ .* in [0-9.]+s' "$f" || echo "  (cut at ${limit} s: no summary line)"
      done
      grep -hE '^\[gw[0-9]+\].* (FAILED|ERROR) ' "$OUT"/shard*.log | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u
      ! grep -qhE '^\[gw[0-9]+\].* (FAILED|ERROR) ' "$OUT"/shard*.log || rc=1;;
    sh)
      bash -c "$1" 2>&1; rc=$(( rc | $? )); shift; [ $# -gt 0 ] && [ "$1" == "--" ] && shift;;
    *) echo "unknown step $step"; exit 2;;
  esac
done
exit $rc
