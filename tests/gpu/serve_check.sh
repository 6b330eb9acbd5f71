#!/bin/sh
# serve_check.sh — the whole system on the GPU with the real model (`make gpu-test-serve`):
# kvpoold on the cuda backend, routerd and workerd (TP = 1) through deploy/run-local.sh, and a
# greedy answer to a prompt of ~700 tokens taken three ways:
#   whole    the router prefills the prompt in one step (max_prefill_chunk 0);
#   chunks   in chunks of 128 tokens, two chunks of budget a step, so the later chunks run at
#            positions 128, 256, ... over the pages and the BF16 sink the first one wrote;
#   cpu      the cpu backend (TP = 2), whole prompt: the numeric reference;
#   hit      the chunked run's system asked the same prompt again: a prefix hit on the pages
#            the first answer's prefill stored (router/README.md "Prefix caching"), its sink
#            rebuilt by the worker; the router's /metrics must count the hit's tokens.
# With BF16 pages (bf16) the three answers must be the same text: the chunked prefill reads the
# same K/V as the whole one in real arithmetic (a zeroed sink, a page read from the wrong place
# or a chunk at the wrong position changes the greedy answer within a few tokens). With FP4
# pages (bitdecoding-nvfp4) a chunk after the first reads the FP4 context and writes its pages
# from it (NUMERICS.md §9), so one code that rounds the other way in an early page changes the
# later chunks: chunked and whole are different computations, and on the cpu backend itself
# their greedy answers part after a few tokens (18 characters here). So with FP4 pages the
# whole answers must agree on FP4_PREFIX characters, the chunked one must start with the same
# FIRST characters, and the line says where each pair parts (the cpu's own chunked answer
# beside it). The hit reads the pages the chunked prefill wrote and prefills the rest in the
# same chunks, so its answer must equal the chunked one for either pool.
#
#   tests/gpu/serve_check.sh BIN_DIR MODEL [OUT_DIR]
#
# Prints PASS/FAIL lines; exits 1 on a FAIL, 2 on a setup error. The answers and the daemons'
# logs of a failing run stay in OUT_DIR (default build/serve_check).
set -u
BIN=$1
MODEL=$2
OUT=${3:-build/serve_check}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TOKENS=48
FP4_PREFIX=40
FIRST=4
TEXT=/usr/share/common-licenses/GPL-3
[ -r "$TEXT" ] || TEXT=$ROOT/LICENSE
mkdir -p "$OUT" || exit 2
[ -r "$MODEL" ] || { echo "serve_check: no model at $MODEL" >&2; exit 2; }
# about 700 tokens of plain text: the 3000 characters after the first 1000
head -c 4000 "$TEXT" | tail -c 3000 >"$OUT/prompt.txt" || exit 2
fails=0

# answer NAME KV BACKEND TP ROUTER_ARGS [HIT]: the greedy answer into $OUT/NAME.txt; with HIT,
# the same prompt again into $OUT/NAME-hit.txt and the router's metrics into $OUT/NAME.metrics
answer() {
	cl="'$BIN/bdfp4' client --router \"\$BD_FRONT_EP\" --raw --max-tokens $TOKENS --wait-ready 120 @'$OUT/prompt.txt'"
	cmd="$cl >'$OUT/$1.txt'"
	[ -n "${6:-}" ] && cmd="$cmd && $cl >'$OUT/$1-hit.txt' && python3 -c \"import os, urllib.request; print(urllib.request.urlopen(os.environ['BD_HTTP_URL'] + '/metrics').read().decode())\" >'$OUT/$1.metrics'"
	BD_KEEP_RUN=0 BD_BACKEND=$3 BD_TP=$4 BD_KV=$2 BD_ROUTER_ARGS=$5 BD_RUN_CMD="$cmd" \
		sh "$ROOT/deploy/run-local.sh" "$BIN" "$MODEL" "" "$OUT" >"$OUT/$1.log" 2>&1
}

# common PREFIX_FILE_A FILE_B: the length in characters of the common prefix
common() {
	python3 - "$1" "$2" <<'EOF'
import sys
a, b = (open(f, encoding="utf-8", errors="replace").read() for f in sys.argv[1:3])
n = 0
while n < min(len(a), len(b)) and a[n] == b[n]:
	n += 1
print(n)
EOF
}

for kv in bf16 bitdecoding-nvfp4; do
	ok=1
	answer "$kv-whole" "$kv" cuda 1 "--max-prefill-chunk 0 --max-prefill-tokens 8192" || ok=0
	answer "$kv-chunks" "$kv" cuda 1 "--max-prefill-chunk 128 --max-prefill-tokens 256" hit ||
		ok=0
	answer "$kv-cpu" "$kv" cpu 2 "--max-prefill-chunk 0 --max-prefill-tokens 8192" || ok=0
	[ "$kv" = bf16 ] ||
		answer "$kv-cpu-chunks" "$kv" cpu 2 "--max-prefill-chunk 128 --max-prefill-tokens 256" ||
		ok=0
	if [ $ok = 0 ]; then
		echo "FAIL: $kv: a run failed (logs: $OUT/$kv-*.log)"
		fails=$((fails + 1))
		continue
	fi
	n_w=$(wc -c <"$OUT/$kv-whole.txt")
	c_chunk=$(common "$OUT/$kv-whole.txt" "$OUT/$kv-chunks.txt")
	c_cpu=$(common "$OUT/$kv-cpu.txt" "$OUT/$kv-whole.txt")
	line="$kv: $TOKENS greedy tokens ($n_w bytes whole); the cpu agrees with whole for $c_cpu characters, chunks of 128 with whole for $c_chunk"
	if [ "$n_w" -lt $FP4_PREFIX ]; then
		echo "FAIL: $line (an answer shorter than $FP4_PREFIX bytes says nothing)"
		fails=$((fails + 1))
	elif [ "$kv" = bf16 ]; then
		if cmp -s "$OUT/$kv-whole.txt" "$OUT/$kv-chunks.txt" &&
			cmp -s "$OUT/$kv-whole.txt" "$OUT/$kv-cpu.txt"; then
			echo "PASS: $line (all equal)"
		else
			echo "FAIL: $line (BF16 pages: the three must be equal)"
			fails=$((fails + 1))
		fi
	else
		c_own=$(common "$OUT/$kv-cpu.txt" "$OUT/$kv-cpu-chunks.txt")
		line="$line (the cpu's chunks with its whole for $c_own)"
		if [ "$c_cpu" -ge $FP4_PREFIX ] && [ "$c_chunk" -ge $FIRST ]; then
			echo "PASS: $line; wanted $FP4_PREFIX and $FIRST"
		else
			echo "FAIL: $line; wanted $FP4_PREFIX and $FIRST"
			fails=$((fails + 1))
		fi
	fi
	hits=$(sed -n 's/^bdfp4:prefix_cache_hits_total{[^}]*} //p' "$OUT/$kv-chunks.metrics")
	if [ "${hits:-0}" -gt 0 ] && cmp -s "$OUT/$kv-chunks.txt" "$OUT/$kv-chunks-hit.txt"; then
		echo "PASS: $kv: the same prompt again is a prefix hit of ${hits} tokens and answers as the chunked run"
	else
		echo "FAIL: $kv: the second chunked answer (hit tokens: ${hits:-none}) differs for $(common "$OUT/$kv-chunks.txt" "$OUT/$kv-chunks-hit.txt") characters or was no hit"
		fails=$((fails + 1))
	fi
done
[ $fails -eq 0 ] || exit 1
exit 0
