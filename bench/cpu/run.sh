#!/bin/sh
# run.sh — `make bench-cpu`: the CPU backend's decode, bf16 KV against bitdecoding-nvfp4 KV, and
# llama.cpp's own llama-bench on the same GGUF file, side by side.
#
# usage: sh bench/cpu/run.sh BIN_DIR [RESULTS_FILE]
#   1. bench_attn_cpu: decode attention per token in the model's shape, reference vs SIMD, one
#      thread (CPU time) and BD_THREADS threads (wall time); bench_threads: the model's decode
#      step at each context on 1 thread against BD_THREADS; with oneDNN's header present,
#      gemv_eval: one decode step's weight products by OpenBLAS FP32 and oneDNN BF16/INT8;
#   2. at three contexts — the chat prompt "Describe how to make a cup of tea." (39 tokens) and
#      the first 9000 / 31000 bytes of the GPL-3 text (1943 / 6606 tokens) — `bdfp4 generate
#      --stats` with bf16 and bitdecoding-nvfp4 KV, and (with BD_LLAMA) `llama-bench -p 0 -n
#      TOKENS -d CONTEXT` (decode of TOKENS tokens after CONTEXT tokens of cache), the three
#      alternating within each round, BD_ROUNDS rounds; the median decode tok/s and the largest
#      peak RSS (/usr/bin/time's maximum resident set) of each.
# The markdown tables go to stdout and, with RESULTS_FILE, are appended to it under a heading
# with the date, machine, commit, command and load average.
# Environment: BD_THREADS (2) bdfp4's (generate --threads) and llama.cpp's threads; BD_ROUNDS (1);
# BD_CONTEXTS ("39 1943 6606": which of the three prompts); BD_STEP_CONTEXTS (BD_CONTEXTS) those
# of bench_threads; BD_TOKENS (64) generated tokens per
# run; BD_MODEL (models/SmolLM2-135M-Instruct.Q4_1.gguf); BD_LLAMA: empty, no llama.cpp
# columns; "build", build llama-bench with bench/cpu/llama_build.sh (PyPI's llama-cpp-python
# source, in .deps/); else the path of a llama-bench binary.
set -eu
BIN=${1:?usage: run.sh BIN_DIR [RESULTS_FILE]}
OUTF=${2:-}
THREADS=${BD_THREADS:-2}
ROUNDS=${BD_ROUNDS:-1}
CONTEXTS=${BD_CONTEXTS:-39 1943 6606}
STEP_CONTEXTS=${BD_STEP_CONTEXTS:-$CONTEXTS}
TOKENS=${BD_TOKENS:-64}
MODEL=${BD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA=${BD_LLAMA:-}
GPL=/usr/share/common-licenses/GPL-3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# the SIMD decode attention is the default (lib/quant/bd_attn_cpu.h); BD_ATTN_ISA=ref measures
# the reference decoder. bdfp4 generate --threads sets OpenBLAS's threads and the model's pool.
export OPENBLAS_NUM_THREADS="$THREADS"

if [ "$LLAMA" = build ]; then
	LLAMA=$(sh bench/cpu/llama_build.sh)/bin/llama-bench
fi
[ -z "$LLAMA" ] || [ -x "$LLAMA" ] || { echo "run.sh: no llama-bench at $LLAMA" >&2; exit 2; }
SYSTEMS="bf16 bitdecoding-nvfp4${LLAMA:+ llama.cpp}"

prompt_text() { # context → the text of its prompt (the 39-token chat prompt is run_one's)
	case "$1" in
	1943) head -c 9000 "$GPL" ;;
	6606) head -c 31000 "$GPL" ;;
	*) echo "run.sh: no prompt for context $1 (39, 1943, 6606)" >&2; exit 2 ;;
	esac
}

# /usr/bin/time's line "RSS KiB" at the end of $TMP/err → MiB
peak_mib() {
	sed -n 's/^RSS \([0-9]*\)$/\1/p' "$TMP/err" | tail -n 1 | awk '{ printf "%.0f", $1 / 1024 }'
}

run_one() { # system context → "tok/s peak_MiB"
	if [ "$1" = llama.cpp ]; then
		/usr/bin/time -f 'RSS %M' "$LLAMA" -m "$MODEL" -t "$THREADS" -p 0 -n "$TOKENS" \
			-d "$2" -r 1 -o csv 2>"$TMP/err" >"$TMP/out"
		# the CSV's avg_ts column, found by its header name
		tps=$(awk -F, '{ gsub(/"/, "") }
			NR == 1 { for (i = 1; i <= NF; i++) if ($i == "avg_ts") c = i }
			NR == 2 && c { print $c }' "$TMP/out")
	else
		if [ "$2" = 39 ]; then
			/usr/bin/time -f 'RSS %M' "$BIN/bdfp4" generate --model "$MODEL" --stats \
				--threads "$THREADS" --kv "$1" --max-tokens "$TOKENS" --chat \
				"Describe how to make a cup of tea." 2>"$TMP/err" >/dev/null
		else
			/usr/bin/time -f 'RSS %M' "$BIN/bdfp4" generate --model "$MODEL" --stats \
				--threads "$THREADS" --kv "$1" --max-tokens "$TOKENS" "$(prompt_text "$2")" \
				2>"$TMP/err" >/dev/null
		fi
		tps=$(sed -n 's/.*decode \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/err" | tail -n 1)
	fi
	if [ -z "$tps" ]; then
		echo "run.sh: $1 at $2 tokens gave no decode rate:" >&2
		cat "$TMP/err" >&2
		exit 1
	fi
	echo "$tps $(peak_mib)"
}

median() {
	sort -g | awk '{ v[NR] = $1 }
		END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

{
	echo "### Decode attention per token (bench_attn_cpu)"
	echo
	"$BIN/bench_attn_cpu" --repeats 9
	echo
	"$BIN/bench_attn_cpu" --repeats 9 --threads "$THREADS" | tail -n +2
	echo
} >"$TMP/attn.md"
cat "$TMP/attn.md"

# the decode step on 1 thread against BD_THREADS (bench/bench_threads.c): the model's pool
{
	echo "### Decode step, 1 thread against $THREADS (bench_threads)"
	echo
	"$BIN/bench_threads" --model "$MODEL" --threads "$THREADS" --contexts "$(echo $STEP_CONTEXTS |
		tr ' ' ',')" --steps 32
	echo
} >"$TMP/thr.md"
cat "$TMP/thr.md"

# the decode step's weight products by the libraries Debian ships (bench/cpu/gemv_eval.c), when
# oneDNN's header is there (libdnnl-dev)
: >"$TMP/gemv.md"
if [ -f /usr/include/oneapi/dnnl/dnnl.h ] &&
	${CC:-cc} -O2 -o "$TMP/gemv_eval" bench/cpu/gemv_eval.c -lopenblas -ldnnl -lm; then
	{
		echo "### The decode step's weight products (gemv_eval), SmolLM2-135M's shapes"
		for t in 1 "$THREADS"; do
			echo
			echo "$t thread(s):"
			echo
			OMP_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t "$TMP/gemv_eval" --repeats 9
		done
		echo
	} >"$TMP/gemv.md"
	cat "$TMP/gemv.md"
fi

for r in $(seq "$ROUNDS"); do
	for c in $CONTEXTS; do
		# the systems' order turns with the round, so none always runs first
		set -- $SYSTEMS
		i=0
		while [ "$i" -lt $(((r - 1) % $#)) ]; do
			first=$1; shift; set -- "$@" "$first"; i=$((i + 1))
		done
		for sys in "$@"; do
			res=$(run_one "$sys" "$c")
			echo "${res% *}" >>"$TMP/tps.$sys.$c"
			echo "${res#* }" >>"$TMP/rss.$sys.$c"
			echo "round $r: $sys context $c: decode ${res% *} tok/s, peak RSS ${res#* } MiB;" \
				"load $(cut -d' ' -f1 /proc/loadavg)" >&2
		done
	done
done
{
	echo "### Decode, $THREADS threads, $TOKENS generated tokens, median of $ROUNDS alternated runs"
	echo
	printf "| context tokens | bdfp4 bf16 tok/s | bdfp4 nvfp4 tok/s | nvfp4 / bf16 |"
	[ -z "$LLAMA" ] || printf " llama.cpp tok/s | bdfp4 nvfp4 / llama.cpp |"
	printf " bf16 peak RSS | nvfp4 peak RSS |"
	[ -z "$LLAMA" ] || printf " llama.cpp peak RSS |"
	echo
	printf "| --- | --- | --- | --- |"
	[ -z "$LLAMA" ] || printf " --- | --- | --- |"
	echo " --- | --- |"
	for c in $CONTEXTS; do
		b=$(median <"$TMP/tps.bf16.$c")
		n=$(median <"$TMP/tps.bitdecoding-nvfp4.$c")
		printf "| %s | %s | %s | %s |" "$c" "$b" "$n" "$(awk "BEGIN { printf \"%.2f\", $n / $b }")"
		if [ -n "$LLAMA" ]; then
			l=$(median <"$TMP/tps.llama.cpp.$c")
			printf " %s | %s |" "$l" "$(awk "BEGIN { printf \"%.2f\", $n / $l }")"
		fi
		printf " %s MiB | %s MiB |" "$(sort -g "$TMP/rss.bf16.$c" | tail -n 1)" \
			"$(sort -g "$TMP/rss.bitdecoding-nvfp4.$c" | tail -n 1)"
		[ -z "$LLAMA" ] || printf " %s MiB |" "$(sort -g "$TMP/rss.llama.cpp.$c" | tail -n 1)"
		echo
	done
	echo
} >"$TMP/gen.md"
cat "$TMP/gen.md"

if [ -n "$OUTF" ]; then
	commit=${BD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
	cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
	{
		echo
		echo "## CPU decode, bdfp4 bf16 / bitdecoding-nvfp4 KV${LLAMA:+ and llama.cpp}" \
			"(make bench-cpu) — $(date -u '+%Y-%m-%d %H:%M') UTC"
		echo
		echo "Machine: $cpu, $(nproc) cores; commit $commit; model $MODEL; command:" \
			"\`BD_THREADS=$THREADS BD_ROUNDS=$ROUNDS BD_TOKENS=$TOKENS" \
			"BD_CONTEXTS=\"$CONTEXTS\" BD_STEP_CONTEXTS=\"$STEP_CONTEXTS\"${LLAMA:+ BD_LLAMA=$LLAMA} sh bench/cpu/run.sh $BIN\`;" \
			"load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)."
		[ -z "$LLAMA" ] || echo "llama.cpp: \`llama-bench -m MODEL -t $THREADS -p 0" \
			"-n $TOKENS -d CONTEXT -r 1 -o csv\` built by bench/cpu/llama_build.sh" \
			"(llama-cpp-python ${LLAMA_PY_VERSION:-0.3.36}'s vendored llama.cpp)."
		echo
		cat "$TMP/attn.md" "$TMP/thr.md" "$TMP/gemv.md" "$TMP/gen.md"
	} >>"$OUTF"
fi
