#!/bin/sh
# passkey.sh — `make bench-passkey`: passkey retrieval accuracy of the KV configurations on the
# embedded SmolLM2-135M (bdfp4 eval-passkey), one table per context.
#
# usage: sh bench/passkey.sh BIN_DIR [RESULTS_FILE]
# Haystacks are cut from the texts the KL tables use (Debian's common licenses and three Node.js
# API pages); 10 depths x 10 keys = 100 trials per context, greedy; configurations bf16 (the
# reference's rerun), fp8, trtllm-nvfp4, bitdecoding-nvfp4, bitdecoding-mxfp4. Each context's
# per-trial records go to passkey-ctxN.log in BD_LOG_DIR (default: a temporary directory);
# `bdfp4 eval-passkey --summarize LOG` reports a run cut short.
# The markdown tables go to stdout and, with RESULTS_FILE, are appended to it under a heading
# with the date, machine, commit, command and load average.
# Environment: BD_CONTEXTS ("2048 4096 8192"), BD_THREADS (2), BD_DEPTHS (10), BD_KEYS (10),
# BD_NICE (5), BD_LOG_DIR.
set -eu
BIN=${1:?usage: passkey.sh BIN_DIR [RESULTS_FILE]}
OUTF=${2:-}
CONTEXTS=${BD_CONTEXTS:-2048 4096 8192}
THREADS=${BD_THREADS:-2}
DEPTHS=${BD_DEPTHS:-10}
KEYS=${BD_KEYS:-10}
NICE=${BD_NICE:-5}
LOGD=${BD_LOG_DIR:-$(mktemp -d)}
L=/usr/share/common-licenses
D=/usr/share/doc/nodejs/api
TEXTS="$L/GPL-3 $L/Apache-2.0 $L/GPL-2 $L/LGPL-2.1 $L/GFDL-1.3 $L/MPL-2.0 $L/MPL-1.1 $L/Artistic \
$L/CC0-1.0 $D/stream.md $D/process.md $D/http.md"
commit=${BD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
mkdir -p "$LOGD"

for c in $CONTEXTS; do
	log="$LOGD/passkey-ctx$c.log"
	cmd="nice -n $NICE bdfp4 eval-passkey --ctx $c --depths $DEPTHS --keys $KEYS --threads $THREADS --no-calib --log $log TEXTS"
	# shellcheck disable=SC2086 # TEXTS is a list of paths without spaces
	nice -n "$NICE" "$BIN/bdfp4" eval-passkey --ctx "$c" --depths "$DEPTHS" --keys "$KEYS" \
		--threads "$THREADS" --no-calib --log "$log" $TEXTS >"$LOGD/passkey-ctx$c.out"
	cat "$LOGD/passkey-ctx$c.out"
	if [ -n "$OUTF" ]; then
		{
			echo
			echo "## Passkey retrieval at context $c (make bench-passkey) — $(date -u '+%Y-%m-%d %H:%M') UTC"
			echo
			echo "Machine: $cpu, $(nproc) cores; commit $commit; load average at the end:" \
				"$(cut -d' ' -f1-3 /proc/loadavg). Command (TEXTS: $TEXTS):"
			echo
			echo '```'
			echo "$cmd"
			echo '```'
			sed -n '/^| config/,$p' "$LOGD/passkey-ctx$c.out"
			grep '^wall time' "$LOGD/passkey-ctx$c.out" || true
		} >>"$OUTF"
	fi
done
