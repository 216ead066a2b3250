#!/usr/bin/env bash
# On the GPU machine, after ../shared/gpu's setup put vLLM 0.26.0 in /tmp/site: make this checkout's `preft`
# package importable from there and register its vLLM plugin entry point (no pip build needed).
#   bash .gpu/setup.sh && export PYTHONPATH=/tmp/site && bash loadtest/gpu_env.sh
set -euo pipefail
site=${1:-/tmp/site}
root=$(cd "$(dirname "$0")/.." && pwd)
info="$site/preft_serve-0.1.0.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: preft-serve\nVersion: 0.1.0\n' > "$info/METADATA"
printf '[vllm.general_plugins]\npreft = preft.vllm_plugin:register\n' > "$info/entry_points.txt"
ln -sfn "$root/services/preft" "$site/preft"
python3 -c "import preft.vllm_plugin, importlib.metadata as m; print('preft plugin:', [e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'preft'])"
