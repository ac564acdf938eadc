# Sourced by scripts/*.sh: installs the Debian packages latentd builds with, once.
# Quiet when everything is present; uses sudo when not root.
LATENTD_PACKAGES=(
  bazel-bootstrap bazel-rules-java
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  prometheus-cpp-dev prometheus
  python3 python3-grpcio python3-protobuf python3-numpy
)

latentd_ensure_packages() {
  local missing=()
  local p
  for p in "${LATENTD_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  local sudo=()
  [[ $(id -u) -ne 0 ]] && sudo=(sudo)
  echo "latentd: installing ${missing[*]}" >&2
  "${sudo[@]}" apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
}

# nvcc is not a Debian package; without it the build falls back to the CPU-only config.
latentd_cuda_config() {
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then echo ""; else echo "--config=nocuda"; fi
}
