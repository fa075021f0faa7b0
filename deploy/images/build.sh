#!/usr/bin/env bash
# Builds slipstream's images from the repository root: the service image, and the torch image for CPU (`cpu`, what
# deploy/compose/cpu.yml and the tests run) or for CUDA nodes (`gpu`, on a CUDA PyTorch base).
#   deploy/images/build.sh [cpu|gpu]
# With podman and a TLS-inspecting proxy or a local wheel folder (PIP_CERT / PIP_FIND_LINKS set), pip inside the build
# is given the CA bundle and the folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
flavour="${1:-cpu}"
engine="$(command -v podman || command -v docker)"
args=()
if [[ "$engine" == *podman ]]; then
  [[ -n "${PIP_CERT:-}" ]] && args+=(-v "$PIP_CERT:$PIP_CERT:ro" --env "PIP_CERT=$PIP_CERT")
  [[ -n "${PIP_FIND_LINKS:-}" ]] && args+=(-v "$PIP_FIND_LINKS:$PIP_FIND_LINKS:ro" --env "PIP_FIND_LINKS=$PIP_FIND_LINKS")
fi
build() {  # name dockerfile [build args…]
  local started=$SECONDS
  "$engine" build -q "${args[@]}" -t "$1" -f "$2" "${@:3}" . >/dev/null
  echo "built $1 in $((SECONDS - started)) s: $("$engine" image inspect "$1" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}')"
}
build slipstream-service:latest deploy/images/service.Dockerfile
if [[ "$flavour" == cpu ]]; then
  # PyTorch's CPU index, unless a local wheel folder holds the CPU build (as on the development machines).
  index="https://download.pytorch.org/whl/cpu"
  [[ -n "${PIP_FIND_LINKS:-}" ]] && index=""
  build slipstream-torch:cpu deploy/images/torch.Dockerfile --build-arg BASE=python:3.11-slim \
    --build-arg TORCH=torch==2.13.0 --build-arg "TORCH_INDEX=$index"
else
  build slipstream-torch:latest deploy/images/torch.Dockerfile
fi
