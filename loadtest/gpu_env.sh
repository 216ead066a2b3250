#!/usr/bin/env bash
# On the GPU machine, after ../shared/gpu's setup put vLLM 0.26.0 in /tmp/site: make this checkout's `preft`
# package importable from there and register its vLLM plugin entry point (no pip build needed).
#   bash .gpu/setup.sh && export PYTHONPATH=/tmp/site && bash loadtest/gpu_env.sh
# With `bash loadtest/gpu_env.sh --wheels .gpu/extra` (here, before the transfer) it downloads instead the few
# packages the serving engine's tests import beyond vLLM's (the image may lack them); carried in `.gpu/extra`, they
# are installed there into /tmp/extra, to go last on PYTHONPATH (the image's own packages first).
# With `bash loadtest/gpu_env.sh --split .gpu` (here, after ../shared/gpu/bundle.sh) it cuts the vLLM bundle into three
# parts of 29 MiB and makes .gpu/setup.sh wait for all three: with this tree (~20 MiB) a call carries 64 MiB at most,
# so the transfer is call 1 `part_aa` + `whl1`, call 2 `part_ab` + `extra`, call 3 `part_ac` + `whl` + `extra`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--split" ]; then
  dir=${2:?folder}
  whole=$(mktemp)
  cat "$dir"/part_a? > "$whole"  # (part_aa, part_ab[, part_ac]: in order)
  rm -f "$dir"/part_a?
  split -b 29M -a 1 "$whole" "$dir/part_a"
  rm -f "$whole"
  grep -q '\[ -f /root/stage/part_ac \]' "$dir/setup.sh" ||
    sed -i 's#\[ -f /root/stage/part_ab \] \&\&#[ -f /root/stage/part_ab ] \&\& [ -f /root/stage/part_ac ] \&\&#' "$dir/setup.sh"
  grep -q '\[ -f /root/stage/part_ac \]' "$dir/setup.sh" || { echo "$dir/setup.sh: no unpack condition to extend" >&2; exit 1; }
  ls -l "$dir"/part_a?
  exit 0
fi
if [ "${1:-}" = "--wheels" ]; then
  for p in pydantic-settings python-dotenv redis prometheus-client psutil; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "${2:?folder}" "$p"
  done
  exit 0
fi
site=${1:-/tmp/site}
if compgen -G "$root/.gpu/extra/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/extra "$root"/.gpu/extra/*.whl
  echo "extra packages in /tmp/extra (put it last on PYTHONPATH)"
fi
info="$site/preft_serve-0.1.0.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: preft-serve\nVersion: 0.1.0\n' > "$info/METADATA"
printf '[vllm.general_plugins]\npreft = preft.vllm_plugin:register\n' > "$info/entry_points.txt"
ln -sfn "$root/services/preft" "$site/preft"
python3 -c "import preft.vllm_plugin, importlib.metadata as m; print('preft plugin:', [e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'preft'])"
