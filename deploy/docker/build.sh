#!/usr/bin/env bash
# Build (and with --push, push) the images, tagged with the package version from pyproject.toml:
#   <registry>/preft-service:<version>       deploy/docker/Dockerfile.service (gateway, registry, preft-admin)
#   <registry>/preft-engine:<version>-cpu    deploy/docker/Dockerfile.engine, VARIANT=cpu
#   <registry>/preft-engine:<version>-gpu    deploy/docker/Dockerfile.engine, VARIANT=gpu (CUDA 13.0 base)
# The tags are the ones the chart (image.*.tag) and the kustomize overlays (images:) name for this version.
#
#   bash deploy/docker/build.sh [--registry REGISTRY] [--push] [--print] [service] [engine-cpu] [engine-gpu]
#
# With no image named it builds all three. It uses docker, podman or buildah, whichever it finds first; with
# --print, or where none is installed, it prints the exact commands instead of running them (exit 0 with --print,
# 3 without).
set -euo pipefail
cd "$(dirname "$0")/../.."

registry="${PREFT_IMAGE_REGISTRY:-registry.example.com/preft-serve}"
push=0 print=0 images=()
while [ $# -gt 0 ]; do
  case "$1" in
    --registry) registry="${2:?--registry needs a value}"; shift 2 ;;
    --push) push=1; shift ;;
    --print) print=1; shift ;;
    service|engine-cpu|engine-gpu) images+=("$1"); shift ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#images[@]} -gt 0 ] || images=(service engine-cpu engine-gpu)

version="$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
builder=""
for candidate in docker podman buildah; do
  if command -v "$candidate" >/dev/null 2>&1; then builder="$candidate"; break; fi
done
if [ "$print" = 1 ] || [ -z "$builder" ]; then run=(echo); else run=(); fi
build=("${builder:-docker}" build)
[ "${builder}" = buildah ] && build=(buildah build)
push_cmd=("${builder:-docker}" push)

for image in "${images[@]}"; do
  case "$image" in
    service) tag="$registry/preft-service:$version"; args=(-f deploy/docker/Dockerfile.service) ;;
    engine-cpu) tag="$registry/preft-engine:$version-cpu"; args=(-f deploy/docker/Dockerfile.engine --build-arg VARIANT=cpu) ;;
    engine-gpu)
      tag="$registry/preft-engine:$version-gpu"
      args=(-f deploy/docker/Dockerfile.engine --build-arg VARIANT=gpu --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-cu130) ;;
  esac
  "${run[@]}" "${build[@]}" "${args[@]}" -t "$tag" .
  if [ "$push" = 1 ]; then "${run[@]}" "${push_cmd[@]}" "$tag"; fi
done

if [ -z "$builder" ] && [ "$print" = 0 ]; then
  echo "build.sh: no docker, podman or buildah here: the commands above are what to run where one is" >&2
  exit 3
fi
