#!/usr/bin/env bash
# Build the pinned llama.cpp (the tree vendored by the PyPI sdist llama-cpp-python==0.3.36, ggml-org/llama.cpp@0c1e57098)
# for the CPU, into a cache outside the repository; reused when the binaries are already there.
#
#   bash scripts/build_llamacpp.sh            # prints the folder holding llama-server etc. (last line)
#
# SPECGRAFT_LLAMACPP_HOME overrides the cache folder (default ~/.cache/specgraft/llama.cpp-0.3.36). The build takes
# about 9 minutes on 2 cores and runs under nice so it does not starve other work.
set -euo pipefail
version="0.3.36"
home="${SPECGRAFT_LLAMACPP_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/specgraft/llama.cpp-$version}"
bin="$home/build/bin"
targets=(llama-server llama-speculative-simple llama-completion llama-quantize)
stamp="$home/BUILT"

built() {
  [ -f "$stamp" ] || return 1
  for t in "${targets[@]}"; do [ -x "$bin/$t" ] || return 1; done
}
if built; then echo "$bin"; exit 0; fi

mkdir -p "$home"
lock="$home/.build.lock"
exec 9>"$lock"
flock 9
if built; then echo "$bin"; exit 0; fi

src="$home/src"
if [ ! -f "$src/CMakeLists.txt" ]; then
  tmp="$(mktemp -d "$home/download.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$tmp" >&2
  tar -xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$tmp"
  rm -rf "$src"
  mv "$tmp/llama_cpp_python-$version/vendor/llama.cpp" "$src"
fi

jobs="$(nproc 2>/dev/null || echo 2)"
nice -n 19 cmake -S "$src" -B "$home/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
nice -n 19 cmake --build "$home/build" --config Release -j "$jobs" --target "${targets[@]}" >&2
echo "llama-cpp-python $version built $(date -u +%FT%TZ)" > "$stamp"
echo "$bin"
