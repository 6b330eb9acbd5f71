#!/bin/sh
# cpu.sh — `make bench-cpu`: the CPU backend's decode, bf16 KV against bitdecoding-nvfp4 KV.
#
# usage: sh bench/cpu.sh BIN_DIR [RESULTS_FILE]
#   1. bench_attn_cpu: decode attention per token in the model's shape, reference vs SIMD, one
#      thread (CPU time) and BD_THREADS threads (wall time);
#   2. `bdfp4 generate --stats` on the embedded SmolLM2-135M at three contexts — the chat prompt
#      "Describe how to make a cup of tea." (39 tokens) and the first 9000 / 31000 bytes of the
#      GPL-3 text (1943 / 6606 tokens) — bf16 and bitdecoding-nvfp4 alternating, BD_ROUNDS
#      rounds, the median decode tok/s and the largest peak RSS of each.
# The markdown tables go to stdout and, with RESULTS_FILE, are appended to it under a heading
# with the date, machine, commit and load average.
# Environment: BD_THREADS (2) OpenBLAS and attention threads; BD_ROUNDS (1); BD_CONTEXTS
# ("39 1943 6606": which of the three prompts); BD_TOKENS (64) generated tokens per run.
set -eu
BIN=${1:?usage: cpu.sh BIN_DIR [RESULTS_FILE]}
OUTF=${2:-}
THREADS=${BD_THREADS:-2}
ROUNDS=${BD_ROUNDS:-1}
CONTEXTS=${BD_CONTEXTS:-39 1943 6606}
TOKENS=${BD_TOKENS:-64}
GPL=/usr/share/common-licenses/GPL-3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# the SIMD decode attention is opt-in (lib/quant/bd_attn_cpu.h): this benchmark measures it
export OPENBLAS_NUM_THREADS="$THREADS" BD_ATTN_THREADS="$THREADS" BD_ATTN_ISA=${BD_ATTN_ISA:-auto}

prompt_text() { # context → the text of its prompt (the 39-token chat prompt is run_one's)
	case "$1" in
	1943) head -c 9000 "$GPL" ;;
	6606) head -c 31000 "$GPL" ;;
	*) echo "cpu.sh: no prompt for context $1 (39, 1943, 6606)" >&2; exit 2 ;;
	esac
}

run_one() { # kv context → "tok/s peak_MiB"
	if [ "$2" = 39 ]; then
		"$BIN/bdfp4" generate --stats --kv "$1" --max-tokens "$TOKENS" --chat \
			"Describe how to make a cup of tea." 2>"$TMP/err" >/dev/null
	else
		"$BIN/bdfp4" generate --stats --kv "$1" --max-tokens "$TOKENS" \
			"$(prompt_text "$2")" 2>"$TMP/err" >/dev/null
	fi
	sed -n 's/.*decode \([0-9.]*\) tokens\/s.*peak \([0-9.]*\) MiB.*/\1 \2/p' "$TMP/err" | tail -n 1
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

{
	echo "### Decode attention per token (bench_attn_cpu)"
	echo
	"$BIN/bench_attn_cpu" --repeats 9
	echo
	"$BIN/bench_attn_cpu" --repeats 9 --threads "$THREADS" | tail -n +2
	echo
} >"$TMP/attn.md"
cat "$TMP/attn.md"

for r in $(seq "$ROUNDS"); do
	for c in $CONTEXTS; do
		for kv in bf16 bitdecoding-nvfp4; do
			set -- $(run_one "$kv" "$c")
			echo "$1" >>"$TMP/tps.$kv.$c"
			echo "$2" >>"$TMP/rss.$kv.$c"
			echo "round $r: $kv prompt $c: decode $1 tok/s, peak RSS $2 MiB" >&2
		done
	done
done
{
	echo "### bdfp4 generate, $THREADS threads, $TOKENS generated tokens, median of $ROUNDS"
	echo
	echo "| prompt tokens | bf16 decode tok/s | nvfp4 decode tok/s | nvfp4 / bf16 |" \
		"bf16 peak RSS | nvfp4 peak RSS |"
	echo "| --- | --- | --- | --- | --- | --- |"
	for c in $CONTEXTS; do
		b=$(median <"$TMP/tps.bf16.$c")
		n=$(median <"$TMP/tps.bitdecoding-nvfp4.$c")
		rb=$(sort -g "$TMP/rss.bf16.$c" | tail -n 1)
		rn=$(sort -g "$TMP/rss.bitdecoding-nvfp4.$c" | tail -n 1)
		echo "| $c | $b | $n | $(awk "BEGIN { printf \"%.2f\", $n / $b }") |" \
			"$rb MiB | $rn MiB |"
	done
	echo
} >"$TMP/gen.md"
cat "$TMP/gen.md"

if [ -n "$OUTF" ]; then
	commit=${BD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
	cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
	{
		echo
		echo "## CPU decode, bf16 vs bitdecoding-nvfp4 KV (make bench-cpu) — $(date -u '+%Y-%m-%d %H:%M') UTC"
		echo
		echo "Machine: $cpu, $(nproc) cores; commit $commit; load average at the end:" \
			"$(cut -d' ' -f1-3 /proc/loadavg)."
		echo
		cat "$TMP/attn.md" "$TMP/gen.md"
	} >>"$OUTF"
fi
