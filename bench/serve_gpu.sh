#!/bin/sh
# serve_gpu.sh — the serving benchmark on the GPU (`make bench-serve-gpu`).
#
#   bench/serve_gpu.sh BIN_DIR
#   bench/serve_gpu.sh --report KV_FILE [OUT_DIR]   (the tables again, from a run's raw lines)
#
# The whole system (deploy/run-local.sh: kvpoold on the cuda backend, routerd, workerd) serving
# seeded random weights of a Qwen3-4B shape, once per KV pool (bf16, bitdecoding-nvfp4):
#   - synthetic prefill (workerd --synthetic-prefill: prompts are filled with synthetic KV, only
#     their last token runs through the model), bench/loadgen at each concurrency level and
#     context (prompts of N random token ids), then one B=1 point at the long context;
#   - real prefill at 8K (every prompt token through the model).
# Each level sends 2 × concurrency requests of MAX_TOKENS generated tokens (EOS ignored), so
# every level is bounded; after each level the workers are asked (SIGUSR1) for their decode-step
# timing since the previous one (host upload + launch, device time, the decode call's host wall
# time and rows, each plan's wall time on the worker).
# Two throughputs per level:
#   - decode: Σ decoded rows / Σ host wall time of the worker's decode calls (rank 0), per GPU.
#     A plan's prefill or synthetic fill runs outside its decode call, so a step that carried
#     prefill rows counts only its decode part; scheduling gaps between plans are left out.
#   - end-to-end: generated tokens / the level's wall time at the client, per GPU (mostly
#     prefill at long contexts).
# BD_BENCH_STEADY=N adds a steady-state decode measure at the client (loadgen --steady N): each
# level is then one round of min(concurrency, fit) requests sent at once; from the moment every
# one has its first token until each has N more, tokens / time (then they are cancelled).
# MAX_TOKENS then defaults to N + the largest concurrency + 64 (the first requests keep
# generating while the last ones wait for their prefill).
# Results: $BD_RESULTS_DIR/serve_gpu.md (markdown) and serve_gpu.json, plus serve_gpu.kv (the
# raw key=value lines) and serve_gpu.png (decode throughput and TPOT vs concurrency per KV
# configuration and context: bench/plot.py, where python3-matplotlib is); progress with
# timestamps on stderr.
#
# Environment (defaults in brackets):
#   BD_RESULTS_DIR [build]          BD_BENCH_PRESET [qwen3-4b]
#   BD_BENCH_KVS ["bf16 bitdecoding-nvfp4"]
#   BD_BENCH_LEVELS [1,8,16,32,64]  BD_BENCH_CTXS ["32768 65536"]
#   BD_BENCH_LONG [131072] (B=1 point; empty: none)
#   BD_BENCH_REAL_CTX [8192] (empty: no real-prefill run)  BD_BENCH_REAL_LEVELS [1,8,16,32,64]
#   BD_BENCH_MAX_TOKENS [64]        BD_GPU_MEM_FRACTION [0.5]   BD_TP [1]
#   BD_BENCH_STEADY [empty: off]
set -u

say() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---- plot: plot JSON PNG (bench/plot.py; a machine without matplotlib gets the tables only) ----
plot() {
	py=/usr/bin/python3
	[ -x "$py" ] || py=python3
	"$py" "$(dirname "$0")/plot.py" serve "$1" -o "$2" >&2 || say "no plot $2 (python3-matplotlib missing?)"
}

# ---- tables: tables KV_FILE MD JSON PRESET ------------------------------------------------------
# Reads the raw key=value lines (loadgen's, then mode ctx, then the worker's decode-timing) and
# writes the markdown table with the target lines, and the JSON (every raw key, plus the
# computed dec_tok_s_gpu, dec_src, e2e_tok_s_gpu). Older lines without the decode call's host
# time get a decode throughput from the device time per step (dec_src=device, marked †).
tables() {
	awk -v md="$2" -v js="$3" -v preset="$4" '
function num(s) { return s ~ /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/ }
function has(r, k) { return ((r, k) in R) && R[r, k] != "" }
function addkey(k) { if (!(k in seen)) { seen[k] = 1; keys[++nk] = k } }
# "met (by X)" / "missed by X": how far a ratio is from its target (higher is better)
function verdict_ratio(x, t) {
	if (x >= t) return sprintf("met (%.2f× ≥ %.1f×, %.0f%% above)", x, t, (x / t - 1) * 100)
	return sprintf("missed (%.2f× < %.1f×: %.0f%% short)", x, t, (1 - x / t) * 100)
}
function lvl(r) { return R[r, "kv"] " " R[r, "mode"] " " R[r, "ctx"] " c=" R[r, "conc"] }
{
	n++
	for (i = 1; i <= NF; i++) {
		k = substr($i, 1, index($i, "=") - 1)
		v = substr($i, index($i, "=") + 1)
		R[n, k] = v
		addkey(k)
	}
	tp = has(n, "tp") && R[n, "tp"] > 0 ? R[n, "tp"] : 1
	# decode throughput from the worker (rank 0; every rank runs the same rows)
	if (has(n, "dec_rows") && R[n, "host_sum_ms"] > 0) {
		R[n, "dec_tok_s_gpu"] = sprintf("%.2f", R[n, "dec_rows"] / (R[n, "host_sum_ms"] / 1e3) / tp)
		R[n, "dec_src"] = "host"
	} else if (R[n, "dev_mean"] > 0) {
		R[n, "dec_tok_s_gpu"] = sprintf("%.2f", R[n, "rows_mean"] / (R[n, "dev_mean"] / 1e6) / tp)
		R[n, "dec_src"] = "device"
	}
	R[n, "e2e_tok_s_gpu"] = R[n, "tok_s_gpu"]
	if (has(n, "steady")) steady = 1
}
END {
	addkey("dec_tok_s_gpu"); addkey("dec_src"); addkey("e2e_tok_s_gpu")
	print "## Serving on the GPU: " preset " (random weights), TP=" R[1, "tp"] \
		", bench/serve_gpu.sh\n" > md
	printf "| KV | prefill | context | concurrency | fit in pool | requests ok | decode tok/s per GPU | end-to-end tok/s per GPU |%s TPOT mean | TPOT p50 | TTFT mean | TTFT p50 | rows/step | decode call host µs mean / p50 | plan µs p50 | upload+launch µs mean / p50 / p99 | device µs/step |\n", \
		steady ? " steady tok/s per GPU | steady TPOT |" : "" > md
	printf "|---|---|---:|---:|---:|---:|---:|---:|%s---:|---:|---:|---:|---:|---:|---:|---:|---:|\n", steady ? "---:|---:|" : "" > md
	dagger = 0
	for (r = 1; r <= n; r++) {
		dec = has(r, "dec_tok_s_gpu") ? sprintf("%.1f%s", R[r, "dec_tok_s_gpu"], R[r, "dec_src"] == "device" ? " †" : "") : "–"
		if (R[r, "dec_src"] == "device") dagger = 1
		st = ""
		if (steady) {
			if (has(r, "steady_ok") && R[r, "steady_ok"] == 1)
				st = sprintf(" %.1f (%d req) | %.2f ms |", R[r, "steady_tok_s_gpu"], R[r, "steady_n"], R[r, "steady_tpot_ms"])
			else
				st = " – | – |"
		}
		hst = has(r, "host_mean") ? sprintf("%.1f / %.1f", R[r, "host_mean"], R[r, "host_p50"]) : "–"
		pln = has(r, "plan_p50") ? sprintf("%.1f", R[r, "plan_p50"]) : "–"
		printf "| %s | %s | %d | %d | %d | %d/%d | %s | %.1f |%s %.2f ms | %.2f ms | %.1f ms | %.1f ms | %.1f | %s | %s | %.1f / %.1f / %.1f | %.0f |\n",
			R[r, "kv"], R[r, "mode"], R[r, "ctx"], R[r, "conc"], R[r, "fit"], R[r, "ok"],
			R[r, "requests"], dec, R[r, "tok_s_gpu"], st, R[r, "tpot_mean_ms"], R[r, "tpot_p50_ms"],
			R[r, "ttft_mean_ms"], R[r, "ttft_p50_ms"], R[r, "rows_mean"], hst, pln, R[r, "ul_mean"],
			R[r, "ul_p50"], R[r, "ul_p99"], R[r, "dev_mean"] > md
		kv = R[r, "kv"]
		if (R[r, "mode"] == "synthetic" && R[r, "ctx"] == 65536 && has(r, "dec_tok_s_gpu") && R[r, "dec_tok_s_gpu"] + 0 > peak[kv]) {
			peak[kv] = R[r, "dec_tok_s_gpu"] + 0; peakc[kv] = R[r, "conc"]; peaksrc[kv] = R[r, "dec_src"]
		}
		if (R[r, "mode"] == "synthetic" && R[r, "ctx"] == 65536 && R[r, "steady_ok"] == 1 && R[r, "steady_tok_s_gpu"] + 0 > speak[kv]) {
			speak[kv] = R[r, "steady_tok_s_gpu"] + 0; speakc[kv] = R[r, "conc"]
		}
		if (R[r, "mode"] == "synthetic" && R[r, "ctx"] >= 131072 && R[r, "conc"] == 1) {
			tpot1[kv] = R[r, "tpot_mean_ms"] + 0; host1[kv] = R[r, "host_mean"]
		}
		if (has(r, "ul_p50") && (ulr == 0 || R[r, "ul_p50"] + 0 > ulmax)) { ulmax = R[r, "ul_p50"] + 0; ulr = r }
	}
	print "\nEach level: " (steady ? "one round of min(concurrency, fit) requests (BD_BENCH_STEADY=" R[1, "steady"] ")" : "2 × concurrency requests") ", " R[1, "max_tokens"] " generated tokens each at most (EOS ignored), prompts of random token ids; synthetic prefill fills positions 0..n−2 with synthetic KV and decodes the last prompt token. fit: requests the pool holds at once (pages for prompt + generated tokens, and slots)." > md
	print "\nDecode tok/s per GPU: Σ decoded rows / Σ host wall time of workerd'"'"'s decode calls (rank 0, from the call to its return; a plan'"'"'s prefill or synthetic fill is outside it, and so are the gaps between plans) / GPUs. End-to-end: generated tokens / the level'"'"'s wall time at the client / GPUs (mostly prefill at long contexts)." (steady ? " Steady: from the moment every request has its first token until each has " R[1, "steady"] " more, the tokens that arrived / that time / GPUs, at the client (loadgen --steady); TPOT = requests × time / tokens." : "") " plan µs: a plan'"'"'s wall time on the worker, from its receipt to its StepResult sent. upload+launch: host time per decode call to upload the step metadata and launch it (graph replay); device: the call on the GPU." > md
	if (dagger)
		print "† decode throughput from the device time per step (rows/step / device µs/step): this run'"'"'s workerd reported no host wall time of its decode calls." > md
	fp = "bitdecoding-nvfp4"; bf = "bf16"
	print "\n### Targets\n" > md
	if ((fp in peak) && (bf in peak) && peak[bf] > 0)
		printf "- Peak decode throughput at 64K (max over concurrency): %s %.1f (c=%d), %s %.1f (c=%d) tokens/s per GPU%s: %.2f× — target ≥ 2.8×: %s.\n",
			fp, peak[fp], peakc[fp], bf, peak[bf], peakc[bf],
			peaksrc[fp] == "device" || peaksrc[bf] == "device" ? " (†)" : "",
			peak[fp] / peak[bf], verdict_ratio(peak[fp] / peak[bf], 2.8) > md
	else
		print "- Peak decode throughput at 64K: not measured (needs synthetic 65536 levels of both pools)." > md
	if ((fp in speak) && (bf in speak) && speak[bf] > 0)
		printf "- Peak steady-state decode throughput at 64K (client): %s %.1f (c=%d), %s %.1f (c=%d) tokens/s per GPU: %.2f× — target ≥ 2.8×: %s.\n",
			fp, speak[fp], speakc[fp], bf, speak[bf], speakc[bf], speak[fp] / speak[bf],
			verdict_ratio(speak[fp] / speak[bf], 2.8) > md
	if ((fp in tpot1) && (bf in tpot1) && tpot1[fp] > 0)
		printf "- TPOT at B=1, 128K: %s %.2f ms, %s %.2f ms%s: %.2f× lower — target ≥ 1.8×: %s.\n",
			fp, tpot1[fp], bf, tpot1[bf],
			host1[fp] != "" && host1[bf] != "" ? sprintf(" (decode call %.2f / %.2f ms)", host1[fp] / 1e3, host1[bf] / 1e3) : "",
			tpot1[bf] / tpot1[fp], verdict_ratio(tpot1[bf] / tpot1[fp], 1.8) > md
	else
		print "- TPOT at B=1, 128K: not measured (needs the B=1 131072 point of both pools)." > md
	if (ulr)
		printf "- Largest median decode-step metadata overhead (upload + launch): %.1f µs (%s) — target < 50 µs: %s.\n",
			ulmax, lvl(ulr), ulmax < 50 ? sprintf("met (%.1f µs to spare)", 50 - ulmax) : sprintf("missed by %.1f µs (%.1f× the target)", ulmax - 50, ulmax / 50) > md

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
}' "$1"
}

# ---- --report: the tables of an earlier run's raw lines -----------------------------------------
if [ "${1:-}" = --report ]; then
	if [ $# -lt 2 ] || [ ! -f "$2" ]; then
		echo "usage: bench/serve_gpu.sh --report KV_FILE [OUT_DIR]" >&2
		exit 2
	fi
	OUTD=${3:-$(dirname "$2")}
	mkdir -p "$OUTD" || exit 1
	tables "$2" "$OUTD/serve_gpu.md" "$OUTD/serve_gpu.json" "${BD_BENCH_PRESET:-qwen3-4b}" || exit 1
	plot "$OUTD/serve_gpu.json" "$OUTD/serve_gpu.png"
	cat "$OUTD/serve_gpu.md"
	exit 0
fi

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
		# shellcheck disable=SC2086 # STEADY_ARGS: zero or two words
		"$BIN/loadgen" --router "$BD_FRONT_EP" --pool "$BD_POOL_EP" --levels "$conc" \
			--requests $((2 * conc)) --max-tokens "$BENCH_T" --prompt-tokens "$ctx" \
			--ignore-eos --kv "$TMP" $STEADY_ARGS >/dev/null || rc=1
		t=$(timing)
		if [ -s "$TMP" ]; then
			echo "$(tail -n 1 "$TMP") mode=$BENCH_MODE ctx=$ctx $t" >>"$BENCH_OUT"
			say "  end-to-end $(tail -n 1 "$TMP" | sed 's/.*tok_s_gpu=\([^ ]*\).*tpot_mean_ms=\([^ ]*\).*/tok\/s\/GPU \1, TPOT \2 ms/'), decode tok/s (rank 0) $(echo "$t" | sed -n 's/.*dec_tok_s=\([^ ]*\).*/\1/p'); $t"
		fi
	}

	rc=0
	STEADY_ARGS=${BENCH_STEADY:+--steady $BENCH_STEADY}
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
STEADY=${BD_BENCH_STEADY:-}
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
if [ -n "$STEADY" ]; then
	case $STEADY in *[!0-9]* | 0*) echo "BD_BENCH_STEADY: a positive count" >&2; exit 2 ;; esac
	BENCH_T=${BD_BENCH_MAX_TOKENS:-$((STEADY + MAXC + 64))}
	[ "$BENCH_T" -gt "$STEADY" ] || { echo "BD_BENCH_MAX_TOKENS must exceed BD_BENCH_STEADY" >&2; exit 2; }
else
	BENCH_T=${BD_BENCH_MAX_TOKENS:-64}
fi
BENCH_STEADY=$STEADY
export BENCH_BIN BENCH_OUT BENCH_T BENCH_STEADY
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

tables "$BENCH_OUT" "$RES/serve_gpu.md" "$RES/serve_gpu.json" "$PRESET"
plot "$RES/serve_gpu.json" "$RES/serve_gpu.png"
cat "$RES/serve_gpu.md"
say "tables: $RES/serve_gpu.md, $RES/serve_gpu.json, plot $RES/serve_gpu.png (raw: $BENCH_OUT)"
exit $rc
