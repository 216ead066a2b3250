#!/usr/bin/env bash
# On the GPU machine: one phase of the platform benchmark (loadtest/platform), after loadtest/gpu_stage.sh's chunks
# have all arrived. Each phase fits one 10-minute device command; state (the stack's data, model, adapters, results)
# stays in /root/preft-platform while the machine is held, and each call copies the results so far into $OUT.
#   bash loadtest/gpu_platform.sh platform [args...]     # the stack: cold start, the modes
#   bash loadtest/gpu_platform.sh peers [args...]        # vllm serve: base, then stock multi-LoRA
# The lease, back to back (the machine goes back 30 s after a call; ~4 min of staging, then the phases):
#   here: bash loadtest/gpu_stage.sh; mv loadtest/results /tmp/results-aside   (the tree must stay under ~10 MiB)
#   calls 1-3: carry .gpu/stage/chunk_0N, .gpu/stage/setup.sh, .gpu/stage/MANIFEST, services/preft/api;
#              command `bash .gpu/stage/setup.sh`
#   call 4:    carry chunk_03 and the same; command `bash loadtest/gpu_platform.sh platform --popularity zipf
#              --workloads 1024x128 --no-sweep` (~8 min: unpacking, the engine's start, four modes, cold start)
#   call 5:    `bash loadtest/gpu_platform.sh peers --popularity zipf --workloads 1024x128` (~6 min)
#   call 6:    `bash loadtest/gpu_platform.sh platform --modes lorap,direftp,lora_all --popularity uniform
#              --workloads 1024x128 --no-cold-start` (uniform popularity and the base model's sweep)
#   then here: mv /tmp/results-aside loadtest/results; copy gpu-platform.json/.md from the calls' files into it and
#              `python -m loadtest.platform report --out loadtest/results/gpu-platform` (the plot)
set -euo pipefail
cd "$(dirname "$0")/.."
bash .gpu/stage/setup.sh
# shellcheck disable=SC1091
source /tmp/stage_env.sh
export PYTHONPATH="$PYTHONPATH:$PWD/services:$PWD"
bash loadtest/gpu_env.sh /tmp/site >/dev/null  # our vLLM plugin's entry point, for the engine replica
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
state=/root/preft-platform
mkdir -p "$state" "${OUT:=/tmp/out}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h / /tmp | tail -n +2
set +e
# results straight into $OUT (a call stopped at its limit still returns the runs so far), merged with earlier calls
cp "$state"/gpu-platform.json "$OUT/" 2>/dev/null
# Where the engine's processes are, every 15 s (the replica, vLLM's engine core and worker): a run that stalls says
# in which call. py-spy reads them from outside (it needs ptrace: where that is denied, its error is the file).
( mkdir -p "$OUT/stacks"
  while sleep 15; do
    for pid in $(pgrep -f 'ServeReplica:preft-engine|VLLM::EngineCore|VLLM::Worker'); do
      py-spy dump --pid "$pid" >"$OUT/stacks/$(date +%H%M%S)-$pid.txt" 2>&1
    done
  done ) & sampler=$!
python3 -m loadtest.platform "$@" --preset "${PRESET:-llama8b}" --state-dir "$state" --out "$OUT/gpu-platform" \
  2>&1 | tee "$OUT/$1.log"
rc=${PIPESTATUS[0]}
kill "$sampler" 2>/dev/null
tar -czf "$OUT/stacks.tar.gz" -C "$OUT" stacks 2>/dev/null && rm -rf "$OUT/stacks"
cp "$OUT"/gpu-platform.json "$state/" 2>/dev/null
# the stack's, the peers' and the engine replica's logs: Serve's, and the replica's stdout/stderr (vLLM's own log,
# the pager's), which Ray keeps in the session folder's worker-*.out/.err
tar -czf "$OUT/logs.tar.gz" -C / --ignore-failed-read "${state#/}/stack/logs" "${state#/}/logs" \
  tmp/ray/session_latest/logs/serve $(cd / && ls tmp/ray/session_latest/logs/worker-*.{out,err} 2>/dev/null) 2>/dev/null
exit "$rc"
