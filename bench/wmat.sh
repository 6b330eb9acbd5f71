#!/bin/sh
# wmat.sh — `make bench-wmat`: the CPU model on the file's weight blocks.
#
# usage: sh bench/wmat.sh BIN_DIR MODEL [RESULTS_FILE]
#   1. bench_wmat, one thread: the decode step's weight products by OpenBLAS sgemv on FP32
#      weights and by bd_ggml_gemv on the file's blocks (CPU time), the logits of the two, a
#      512-token prefill of each;
#   2. `bdfp4 generate --stats --kv bf16` at the chat prompt "Describe how to make a cup of
#      tea." (39 tokens) and the first 9000 / 31000 bytes of the GPL-3 text (1943 / 6606
#      tokens): peak RSS, RSS at the last token, decode tok/s (BD_THREADS threads, wall time).
# The markdown tables go to stdout and, with RESULTS_FILE, are appended to it under a heading
# with the date, machine, commit and load average.
# Environment: BD_THREADS (2); BD_CONTEXTS ("39 1943 6606"); BD_TOKENS (32) generated tokens.
set -eu
BIN=${1:?usage: wmat.sh BIN_DIR MODEL [RESULTS_FILE]}
MODEL=${2:?usage: wmat.sh BIN_DIR MODEL [RESULTS_FILE]}
OUTF=${3:-}
THREADS=${BD_THREADS:-2}
CONTEXTS=${BD_CONTEXTS:-39 1943 6606}
TOKENS=${BD_TOKENS:-32}
GPL=/usr/share/common-licenses/GPL-3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

load() { cut -d' ' -f1-3 /proc/loadavg; }

L0=$(load)
OPENBLAS_NUM_THREADS=1 "$BIN/bench_wmat" --model "$MODEL" --steps 9 >"$TMP/wmat.md"
cat "$TMP/wmat.md"

{
	echo
	echo "| prompt tokens | peak RSS MiB | RSS at the last token MiB | decode tok/s |"
	echo "| --- | --- | --- | --- |"
} >"$TMP/gen.md"
for c in $CONTEXTS; do
	case "$c" in
	39) set -- --chat "Describe how to make a cup of tea." ;;
	1943) set -- "$(head -c 9000 "$GPL")" ;;
	6606) set -- "$(head -c 31000 "$GPL")" ;;
	*) echo "wmat.sh: no prompt for context $c (39, 1943, 6606)" >&2; exit 2 ;;
	esac
	OPENBLAS_NUM_THREADS="$THREADS" "$BIN/bdfp4" generate --model "$MODEL" --stats --kv bf16 \
		--max-tokens "$TOKENS" "$@" 2>"$TMP/err" >/dev/null
	sed -n 's/.*prompt \([0-9]*\) tokens.*decode \([0-9.]*\) tokens\/s; RSS at the last token \([0-9.]*\) MiB, peak \([0-9.]*\) MiB.*/| \1 | \4 | \3 | \2 |/p' \
		"$TMP/err" | tail -n 1 >>"$TMP/gen.md"
done
L1=$(load)
cat "$TMP/gen.md"

if [ -n "$OUTF" ]; then
	{
		echo
		echo "### The weights as the file's blocks: products, logits, peak RSS ($(date -u '+%Y-%m-%d %H:%M UTC'))"
		echo
		echo "$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)," \
			"$(nproc) CPUs shared with other work, load average $L0 before, $L1 after;" \
			"commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown);" \
			"\`make bench-wmat\` (\`sh bench/wmat.sh $BIN $MODEL\`): bench_wmat one thread," \
			"\`bdfp4 generate --stats --kv bf16 --max-tokens $TOKENS\` with $THREADS threads."
		echo
		cat "$TMP/wmat.md" "$TMP/gen.md"
	} >>"$OUTF"
fi
