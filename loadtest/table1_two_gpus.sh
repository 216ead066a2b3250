#!/usr/bin/env bash
# Two halves of issue 6's table at once on a machine with two GPUs (one command there may run 10 minutes):
#   bash loadtest/table1_two_gpus.sh OUT_PREFIX "ARGS FOR GPU 0" "ARGS FOR GPU 1"
# Each half is its own bench_table1 process, pinned to one GPU with its own work folder; logs and result files
# go to OUT_PREFIX-gpu{0,1}.{log,json,png}, then one merged OUT_PREFIX.{json,png}. BENCH_TIMEOUT_S bounds both.
# The halves share the host: a host-bound engine (Qwen-0.5B's decode) ran its base passes' decode steps at
# 16-24 ms instead of 11 ms while the other half wrote or loaded adapters (RUNS.md, runs 10-11); measure
# such an engine's A/B comparisons in one process on its own.
set -uo pipefail
out=$1
mkdir -p "$(dirname "$out")"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
# Half the cores' threads each: with both processes' CPU thread pools sized to the whole machine, adapter loads
# ran ~10x slower whenever the other process was loading too (loadtest/results/gpu-table1-logs/run2-*).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / 2 ))}
for gpu in 0 1; do
  args=$2; [ "$gpu" = 1 ] && args=$3
  # shellcheck disable=SC2086  # the arguments are a list of words
  CUDA_VISIBLE_DEVICES=$gpu timeout "${BENCH_TIMEOUT_S:-540}" python3 -m loadtest.bench_table1 $args \
    --workdir "${TMPDIR:-/tmp}/preft-table1-gpu$gpu" --out "$out-gpu$gpu" > "$out-gpu$gpu.log" 2>&1 &
done
wait
grep -h -A60 '^configuration ' "$out"-gpu?.log
parts=$(ls "$out"-gpu?.json 2>/dev/null)
[ -n "$parts" ] && python3 -m loadtest.bench_table1 --merge $parts --out "$out"
tail -n 5 "$out"-gpu?.log
