#!/usr/bin/env bash
# Copies built binaries, and the shared libraries they need that a GPU host may lack (gRPC,
# protobuf, abseil, spdlog...), into one folder that runs on another Linux host:
#   tools/bundle.sh OUTDIR BINARY...     then on the other host: OUTDIR/run NAME [ARGS...]
# The C/C++ runtimes, the CUDA driver and cuBLAS stay out: the GPU host has its own, and
# `run` puts its CUDA library folders on the library path.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 OUTDIR BINARY..." >&2
  exit 2
fi
dest=$1
shift
mkdir -p "$dest/bin" "$dest/lib"
# Libraries every host provides (or must provide itself, like the driver).
host_provided='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcuda|libnvidia|libcublas|libcublasLt)\.'
for binary in "$@"; do
  if [[ ! -f $binary ]]; then
    echo "bundle: $binary: no such file" >&2
    exit 1
  fi
  install -m 0755 "$(readlink -f "$binary")" "$dest/bin/$(basename "$binary")"
  while read -r soname arrow path _; do
    [[ $arrow == "=>" ]] || continue
    [[ $soname =~ $host_provided ]] && continue
    if [[ ! -f $path ]]; then
      echo "bundle: $binary needs $soname, which is not installed here" >&2
      exit 1
    fi
    install -m 0644 "$(readlink -f "$path")" "$dest/lib/$soname"
  done < <(ldd "$binary")
done
cat > "$dest/run" <<'LAUNCHER'
#!/usr/bin/env bash
# Runs bin/NAME with the bundled libraries first, then the host's CUDA libraries.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
name=$1
shift
path="$root/lib"
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/lib/python3*/dist-packages/nvidia/cu*/lib /opt/*/.venv/lib/python3*/site-packages/nvidia/cu*/lib; do
  [[ -d $dir ]] && path+=":$dir"
done
export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$root/bin/$name" "$@"
LAUNCHER
chmod 0755 "$dest/run"
echo "bundle: $(ls "$dest/bin" | wc -l) binaries, $(ls "$dest/lib" | wc -l) libraries in $dest ($(du -sh "$dest" | cut -f1))"
