# Sourced by scripts/*.sh: installs the Debian packages latentd builds with, once.
# Quiet when everything is present; uses sudo when not root.
LATENTD_PACKAGES=(
  bazel-bootstrap bazel-rules-java
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  prometheus-cpp-dev prometheus
  # JSON for model checkpoints (engine/model: config.json, safetensors headers).
  nlohmann-json3-dev
  # BLAS for the CPU attention-layer math (engine/layer: cblas_sgemm, multi-threaded).
  libopenblas-dev
  python3 python3-grpcio python3-protobuf python3-numpy
  # Fuzzing (scripts/fuzz.sh): clang 14 with libFuzzer and the sanitizer runtimes;
  # llvm brings llvm-symbolizer for readable sanitizer stacks.
  clang libclang-rt-14-dev llvm
  # tests/deploy: systemd-analyze (not in Debian's base image), the manifest parser, and
  # the Python package's install into a venv.
  systemd python3-yaml python3-venv python3-pip python3-setuptools python3-wheel
  # Scale-out: the proxy of scripts/cluster.sh, deploy/nginx and its tests (Debian 12's
  # nginx 1.22 has the gRPC proxy and hash ... consistent built in).
  nginx
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
