#!/bin/sh
# serve_gpu.sh — the serving benchmark on the GPU (issue 7, `make bench-serve-gpu`).
#
#   bench/serve_gpu.sh BIN_DIR
#
# The whole system (deploy/run-local.sh: kvpoold on the cuda backend, routerd, workerd) serving
# seeded random weights of a Qwen3-4B shape, once per KV pool (bf16, bitdecoding-nvfp4):
#   - synthetic prefill (workerd --synthetic-prefill: prompts are filled with synthetic KV, only
#     their last token runs through the model), bench/loadgen at each concurrency level and
#     context (prompts of N random token ids), then one B=1 point at the long context;
#   - real prefill at 8K (every prompt token through the model).
# Each level sends 2 × concurrency requests of MAX_TOKENS generated tokens (EOS ignored), so
# every level is bounded; after each level the workers are asked (SIGUSR1) for their decode-step
# timing (host upload + launch, device time) since the previous one.
# Results: $BD_RESULTS_DIR/serve_gpu.md (markdown) and serve_gpu.json, plus serve_gpu.kv (the
# raw key=value lines); progress with timestamps on stderr.
#
# Environment (defaults in brackets):
#   BD_RESULTS_DIR [build]          BD_BENCH_PRESET [qwen3-4b]
#   BD_BENCH_KVS ["bf16 bitdecoding-nvfp4"]
#   BD_BENCH_LEVELS [1,8,16,32,64]  BD_BENCH_CTXS ["32768 65536"]
#   BD_BENCH_LONG [131072] (B=1 point; empty: none)
#   BD_BENCH_REAL_CTX [8192] (empty: no real-prefill run)  BD_BENCH_REAL_LEVELS [1,8,16,32,64]
#   BD_BENCH_MAX_TOKENS [64]        BD_GPU_MEM_FRACTION [0.5]   BD_TP [1]
set -u

say() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---- inner: one system, its levels (run by run-local.sh through BD_RUN_CMD) --------------------
if [ "${1:-}" = --inner ]; then
	BIN=$BENCH_BIN
	W0=${BD_WORKER_PIDS%% *}
	LOG=$BD_RUN_DIR/workerd-0.log
	TMP=$BD_RUN_DIR/level.kv

	# the timing since the last report, as the workers' key=value line
	timing() {
		n0=$(grep -c 'decode-timing' "$LOG")
		kill -USR1 "$W0" 2>/dev/null || return 1
		i=0
		while [ "$(grep -c 'decode-timing' "$LOG")" -le "$n0" ] && [ $i -lt 100 ]; do
			sleep 0.05
			i=$((i + 1))
		done
		grep 'decode-timing' "$LOG" | tail -n 1 | sed 's/.*decode-timing //'
	}

	# one level: conc clients, 2·conc requests of ctx prompt tokens
	level() {
		ctx=$1 conc=$2
		say "$BENCH_KV $BENCH_MODE ctx $ctx: concurrency $conc ($((2 * conc)) requests)"
		rm -f "$TMP"
		"$BIN/loadgen" --router "$BD_FRONT_EP" --pool "$BD_POOL_EP" --levels "$conc" \
			--requests $((2 * conc)) --max-tokens "$BENCH_T" --prompt-tokens "$ctx" \
			--ignore-eos --kv "$TMP" >/dev/null || rc=1
		t=$(timing)
		if [ -s "$TMP" ]; then
			echo "$(tail -n 1 "$TMP") mode=$BENCH_MODE ctx=$ctx $t" >>"$BENCH_OUT"
			say "  $(tail -n 1 "$TMP" | sed 's/.*tok_s_gpu=\([^ ]*\).*tpot_mean_ms=\([^ ]*\).*/tok\/s\/GPU \1, TPOT \2 ms/'); $t"
		fi
	}

	rc=0
	# warm-up (graph capture, first launches), not recorded
	"$BIN/loadgen" --router "$BD_FRONT_EP" --levels 1 --requests 1 --max-tokens 8 \
		--prompt-tokens 1024 --ignore-eos >/dev/null 2>&1
	timing >/dev/null
	for ctx in $BENCH_CTXS; do
		for conc in $(echo "$BENCH_LEVELS" | tr ',' ' '); do
			level "$ctx" "$conc"
		done
	done
	[ -n "$BENCH_LONG" ] && level "$BENCH_LONG" 1
	exit $rc
fi

# ---- outer: the systems, then the tables ------------------------------------------------------
[ $# -ge 1 ] || { echo "usage: bench/serve_gpu.sh BIN_DIR" >&2; exit 2; }
BENCH_BIN=$(cd "$1" && pwd) || exit 1
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
RES=${BD_RESULTS_DIR:-build}
mkdir -p "$RES" || exit 1
RES=$(cd "$RES" && pwd)
BENCH_OUT=$RES/serve_gpu.kv
PRESET=${BD_BENCH_PRESET:-qwen3-4b}
KVS=${BD_BENCH_KVS:-bf16 bitdecoding-nvfp4}
BENCH_T=${BD_BENCH_MAX_TOKENS:-64}
LEVELS=${BD_BENCH_LEVELS:-1,8,16,32,64}
CTXS=${BD_BENCH_CTXS:-32768 65536}
LONG=${BD_BENCH_LONG-131072}
REAL=${BD_BENCH_REAL_CTX-8192}
REAL_LEVELS=${BD_BENCH_REAL_LEVELS:-$LEVELS}
MAXC=0
for c in $(echo "$LEVELS,$REAL_LEVELS" | tr ',' ' '); do
	[ "$c" -gt "$MAXC" ] && MAXC=$c
done
MAXCTX=0
for c in $CTXS $LONG; do
	[ "$c" -gt "$MAXCTX" ] && MAXCTX=$c
done
export BENCH_BIN BENCH_OUT BENCH_T
: >"$BENCH_OUT"
T0=$(date +%s)
rc=0

# one system: MODE KV MAX_SEQ_LEN CONTEXTS LEVELS LONG SYNTHETIC ROUTER_ARGS MAX_PREFILL
run_system() {
	say "== $2 pool, $1 prefill: starting the system (max_seq_len $3)"
	BENCH_MODE=$1 BENCH_KV=$2 BENCH_CTXS=$4 BENCH_LEVELS=$5 BENCH_LONG=$6 \
		BD_SYNTHETIC_PREFILL=$7 BD_ROUTER_ARGS=$8 BD_MAX_PREFILL=$9 \
		BD_BACKEND=cuda BD_TP=${BD_TP:-1} BD_KV=$2 BD_RANDOM_WEIGHTS=$PRESET \
		BD_MAX_SEQ_LEN=$3 BD_SLOTS=$MAXC BD_MAX_BATCH=$MAXC \
		BD_RUN_CMD="sh '$HERE/serve_gpu.sh' --inner" \
		sh "$ROOT/deploy/run-local.sh" "$BENCH_BIN" none "" "${BD_RUN_BASE:-$RES/run}" || rc=1
}

for kv in $KVS; do
	# the pool must hold the longest request: prompt + generated, and a page more
	run_system synthetic "$kv" $((MAXCTX + BENCH_T + 128)) "$CTXS" "$LEVELS" "$LONG" 1 \
		"--max-prefill-tokens 16777216 --max-queue 1024" 8192
	# real prefill; a preempted request comes back as prompt + generated: one prefill of that
	[ -n "$REAL" ] && run_system real "$kv" $((REAL + BENCH_T + 128)) "$REAL" \
		"$REAL_LEVELS" "" 0 "--max-queue 1024" $((REAL + BENCH_T + 128))
done
say "all systems done in $(($(date +%s) - T0)) s"

# ---- tables -------------------------------------------------------------------------------------
awk -v md="$RES/serve_gpu.md" -v js="$RES/serve_gpu.json" -v preset="$PRESET" '
function num(s) { return s ~ /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/ }
{
	n++
	for (i = 1; i <= NF; i++) {
		k = substr($i, 1, index($i, "=") - 1)
		v = substr($i, index($i, "=") + 1)
		R[n, k] = v
		if (!(k in seen)) { seen[k] = 1; keys[++nk] = k }
	}
}
END {
	print "## Serving on the GPU: " preset " (random weights), TP=" R[1, "tp"] \
		", bench/serve_gpu.sh\n" > md
	print "| KV | prefill | context | concurrency | fit in pool | requests ok | decode tok/s per GPU | TPOT mean | TPOT p50 | TTFT mean | TTFT p50 | rows/step | upload+launch µs mean / p50 / p99 | device µs/step |" > md
	print "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" > md
	for (r = 1; r <= n; r++) {
		printf "| %s | %s | %d | %d | %d | %d/%d | %.1f | %.2f ms | %.2f ms | %.1f ms | %.1f ms | %.1f | %.1f / %.1f / %.1f | %.0f |\n",
			R[r, "kv"], R[r, "mode"], R[r, "ctx"], R[r, "conc"], R[r, "fit"], R[r, "ok"],
			R[r, "requests"], R[r, "tok_s_gpu"], R[r, "tpot_mean_ms"], R[r, "tpot_p50_ms"],
			R[r, "ttft_mean_ms"], R[r, "ttft_p50_ms"], R[r, "rows_mean"], R[r, "ul_mean"],
			R[r, "ul_p50"], R[r, "ul_p99"], R[r, "dev_mean"] > md
		if (R[r, "mode"] == "synthetic" && R[r, "ctx"] == 65536 && R[r, "tok_s_gpu"] + 0 > peak[R[r, "kv"]])
			peak[R[r, "kv"]] = R[r, "tok_s_gpu"] + 0
		if (R[r, "mode"] == "synthetic" && R[r, "ctx"] >= 131072 && R[r, "conc"] == 1)
			tpot1[R[r, "kv"]] = R[r, "tpot_mean_ms"] + 0
		if (R[r, "ul_p50"] + 0 > ulmax) ulmax = R[r, "ul_p50"] + 0
	}
	print "\nEach level: 2 × concurrency requests, " R[1, "max_tokens"] " generated tokens each (EOS ignored), prompts of random token ids; synthetic prefill fills positions 0..n−2 with synthetic KV and decodes the last prompt token. fit: requests the pool holds at once (pages for prompt + generated tokens, and slots). Throughput: generated tokens / wall time / GPUs. upload+launch: host time per decode step to upload the step metadata and launch it (graph replay), from workerd; device: the step on the GPU." > md
	fp = "bitdecoding-nvfp4"; bf = "bf16"
	if ((fp in peak) && (bf in peak) && peak[bf] > 0)
		printf "\nPeak decode throughput at 64K: %s %.1f, %s %.1f tokens/s per GPU: %.2f× (target ≥ 2.8×).\n", fp, peak[fp], bf, peak[bf], peak[fp] / peak[bf] > md
	if ((fp in tpot1) && (bf in tpot1) && tpot1[fp] > 0)
		printf "TPOT at B=1, 128K: %s %.2f ms, %s %.2f ms: %.2f× lower (target ≥ 1.8×).\n", fp, tpot1[fp], bf, tpot1[bf], tpot1[bf] / tpot1[fp] > md
	printf "Largest median decode-step upload+launch: %.1f µs (target < 50 µs).\n", ulmax > md

	printf "[\n" > js
	for (r = 1; r <= n; r++) {
		printf "  {" > js
		first = 1
		for (j = 1; j <= nk; j++) {
			k = keys[j]
			if (!((r, k) in R)) continue
			v = R[r, k]
			printf "%s\"%s\": %s", first ? "" : ", ", k, num(v) ? v : "\"" v "\"" > js
			first = 0
		}
		printf "}%s\n", r < n ? "," : "" > js
	}
	printf "]\n" > js
}' "$BENCH_OUT"
cat "$RES/serve_gpu.md"
say "tables: $RES/serve_gpu.md, $RES/serve_gpu.json (raw: $BENCH_OUT)"
exit $rc
