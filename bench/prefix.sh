#!/bin/sh
# prefix.sh — `make bench-prefix`: TTFT and throughput of a shared-system-prompt load with the
# router's prefix caching on and off (loadgen --shared-prefix, deploy/run-local.sh, the embedded
# SmolLM2-135M on the CPU backend, TP=2, bitdecoding-nvfp4 pages).
#
# usage: sh bench/prefix.sh BIN_DIR MODEL [RESULTS_FILE]
# Every request is BD_PROMPT (1152) token ids whose first BD_PREFIX (1024: 8 pages) are the same
# in every request, then BD_MAX_TOKENS (16) greedy tokens, at concurrency BD_LEVELS (1,4). The
# two runs start fresh stacks (an empty pool each); the run with the cache on reports the hit
# rate kvpoold counted. loadgen prints each table and, with RESULTS_FILE, appends it there
# under a heading with the date, machine and commit.
set -eu
BIN=${1:?usage: prefix.sh BIN_DIR MODEL [RESULTS_FILE]}
MODEL=${2:?usage: prefix.sh BIN_DIR MODEL [RESULTS_FILE]}
OUTF=${3:-}
PROMPT=${BD_PROMPT:-1152}
PREFIX=${BD_PREFIX:-1024}
TOKENS=${BD_MAX_TOKENS:-16}
LEVELS=${BD_LEVELS:-1,4}
HERE=$(dirname "$0")
for on in 1 0; do
	args="--levels $LEVELS --max-tokens $TOKENS --prompt-tokens $PROMPT --shared-prefix $PREFIX"
	args="$args --note prefix_cache=$on(bench/prefix.sh)"
	[ -n "$OUTF" ] && args="$args --results $OUTF"
	BD_LOADGEN="$args" BD_ROUTER_ARGS="--prefix-cache=$on" \
		sh "$HERE/../deploy/run-local.sh" "$BIN" "$MODEL" ""
done
