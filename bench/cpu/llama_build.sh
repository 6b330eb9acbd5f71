#!/bin/sh
# llama_build.sh — builds llama.cpp's llama-bench (other targets on request) from the copy vendored
# in the PyPI source distribution of llama-cpp-python (0.3.36 unless LLAMA_PY_VERSION says
# otherwise), in the ignored cache .deps/ (not committed), for bench/cpu/run.sh.
#
# usage: sh bench/cpu/llama_build.sh [CACHE_DIR]    (default .deps/llama-cpp-python-VERSION)
# Prints the directory holding bin/llama-bench on stdout. Reuses a finished build. Needs pip,
# cmake and a C++ compiler; the sdist comes through `pip download` (the package index).
# Environment: LLAMA_PY_VERSION (0.3.36), LLAMA_JOBS (2) parallel compile jobs, LLAMA_TARGETS
# ("llama-bench"; this configuration builds llama.cpp's tools without its server, so not
# llama-cli, which is built on the server's library).
set -eu
VER=${LLAMA_PY_VERSION:-0.3.36}
DIR=${1:-.deps/llama-cpp-python-$VER}
JOBS=${LLAMA_JOBS:-2}
TARGETS=${LLAMA_TARGETS:-llama-bench}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
done=1
for t in $TARGETS; do [ -x "$DIR/build/bin/$t" ] || done=0; done
if [ "$done" = 1 ]; then
	echo "$DIR/build"
	exit 0
fi
SD="$DIR/llama_cpp_python-$VER.tar.gz"
if [ ! -f "$SD" ]; then
	# the source distribution only (its build requirements come as wheels for pip's metadata step)
	python3 -m pip download --no-deps --no-binary llama-cpp-python \
		"llama-cpp-python==$VER" -d "$DIR" >&2
fi
[ -d "$DIR/src" ] || { mkdir -p "$DIR/src" && tar -xzf "$SD" -C "$DIR/src" --strip-components=1; }
# the vendored llama.cpp; CPU only, native instructions, no network fetches, no shared libraries
cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release \
	-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_OPENMP=ON \
	-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$DIR/build" -j "$JOBS" --target $TARGETS >&2
echo "$DIR/build"
