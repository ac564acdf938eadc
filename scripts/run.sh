#!/usr/bin/env bash
# The main job: installs missing Debian packages, builds the daemon and runs it in the
# foreground on 127.0.0.1 (default 127.0.0.1:50051) with its embedded defaults: the CUDA
# backend when a GPU is present, the CPU backend otherwise. Extra arguments are daemon
# flags, e.g. scripts/run.sh --listen=127.0.0.1:6000 --backend=cpu
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
latentd_ensure_packages
bazel build $(latentd_cuda_config) //server:latentd
exec bazel-bin/server/latentd "$@"
