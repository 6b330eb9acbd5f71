#!/bin/sh
# run-local.sh — the main job of `make run`: the whole serving system on this machine, CPU
# backend, without systemd. Starts kvpoold, the router and two tensor-parallel workers in a
# private runtime directory, waits until the router serves, streams the answer to PROMPT with
# `bdfp4 client`, prints `kvpoolctl stats`, stops every daemon with SIGTERM and checks that each
# exits 0.
#
#   deploy/run-local.sh BIN_DIR MODEL "PROMPT" [RUN_DIR]
#
# RUN_DIR (default $XDG_RUNTIME_DIR, else build/run) holds a fresh directory per run with the
# sockets and the daemons' logs; it is removed at the end unless BD_KEEP_RUN=1.
# BD_MAX_TOKENS (default 200) and BD_KV (default bitdecoding-nvfp4) tune the run; with
# BD_LOADGEN="ARGS" set, bench/loadgen runs with ARGS instead of the prompt (make bench-serve).
set -u

BIN=$(cd "$1" && pwd)
MODEL=$2
PROMPT=$3
BASE=${4:-${XDG_RUNTIME_DIR:-build/run}}
MAX_TOKENS=${BD_MAX_TOKENS:-200}
KV=${BD_KV:-bitdecoding-nvfp4}

mkdir -p "$BASE" || exit 1
RT=$(mktemp -d "$(cd "$BASE" && pwd)/bdfp4.XXXXXX") || exit 1
# Unix socket paths must fit in 107 bytes
if [ ${#RT} -gt 80 ]; then
	rmdir "$RT"
	RT=$(mktemp -d /tmp/bdfp4-run.XXXXXX) || exit 1
fi
POOL_SOCK=$RT/kvpool.sock
POOL_EP=ipc://$RT/kvpool-alloc.sock
FRONT_EP=ipc://$RT/router.sock
WORKERS_EP=ipc://$RT/router-workers.sock

POOL_PID= ROUTER_PID= W0_PID= W1_PID=

say() { printf '== %s\n' "$*" >&2; }

show_logs() {
	for f in "$RT"/*.log; do
		[ -s "$f" ] || continue
		printf -- '--- %s (last lines)\n' "$(basename "$f")" >&2
		tail -n 15 "$f" >&2
	done
}

cleanup() {
	for p in $ROUTER_PID $W0_PID $W1_PID $POOL_PID; do
		kill -KILL "$p" 2>/dev/null
	done
	if [ "${BD_KEEP_RUN:-0}" = 1 ]; then
		say "logs and sockets kept in $RT"
	else
		rm -rf "$RT"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
	say "FAILED: $*"
	show_logs
	exit 1
}

alive() { kill -0 "$1" 2>/dev/null; }

# Sends SIGTERM and waits up to 30 s; fails unless the exit status is 0.
stop() {
	name=$1 pid=$2
	kill -TERM "$pid" 2>/dev/null || fail "$name (pid $pid) was already gone"
	i=0
	while alive "$pid" && [ $i -lt 300 ]; do
		sleep 0.1
		i=$((i + 1))
	done
	alive "$pid" && fail "$name did not stop within 30 s of SIGTERM"
	wait "$pid"
	rc=$?
	[ $rc -eq 0 ] || fail "$name exited with status $rc after SIGTERM"
	say "$name stopped (exit 0)"
}

[ -r "$MODEL" ] || fail "no model at $MODEL (make model)"
for b in kvpoold kvpoolctl routerd workerd bdfp4 ${BD_LOADGEN+loadgen}; do
	[ -x "$BIN/$b" ] || fail "no $BIN/$b (make all)"
done
export OPENBLAS_NUM_THREADS=1

say "runtime directory $RT"
say "starting kvpoold (CPU backend, TP=2, $KV)"
"$BIN/kvpoold" --no-config --socket "$POOL_SOCK" --endpoint "$POOL_EP" --backend cpu --tp 2 \
	--kv-config "$KV" --layers 30 --kv-heads 3 --head-dim 64 --max-seq-len 8192 \
	--slots 16 --memory-bytes 256M 2>"$RT/kvpoold.log" &
POOL_PID=$!
i=0
until "$BIN/kvpoolctl" --no-config --endpoint "$POOL_EP" --timeout 500 stats >/dev/null 2>&1; do
	alive $POOL_PID || fail "kvpoold exited"
	i=$((i + 1))
	[ $i -lt 100 ] || fail "kvpoold did not answer within 50 s"
	sleep 0.5
done

say "starting the router"
"$BIN/routerd" --no-config --frontend "$FRONT_EP" --workers "$WORKERS_EP" --pool "$POOL_EP" \
	--model "$MODEL" --tp 2 2>"$RT/routerd.log" &
ROUTER_PID=$!

say "starting workerd rank 0 and rank 1"
for r in 0 1; do
	"$BIN/workerd" --no-config --rank $r --tp 2 --model "$MODEL" --pool-socket "$POOL_SOCK" \
		--router "$WORKERS_EP" --allreduce-dir "$RT" --threads 1 2>"$RT/workerd-$r.log" &
	eval W${r}_PID=$!
done

# the router answers health as soon as it listens; --wait-ready polls until it serves
sleep 0.5
for p in $POOL_PID $ROUTER_PID $W0_PID $W1_PID; do
	alive "$p" || fail "a daemon exited at start"
done
"$BIN/bdfp4" client --router "$FRONT_EP" --wait-ready 180 --health >/dev/null ||
	fail "the router did not start serving"
"$BIN/bdfp4" client --router "$FRONT_EP" --info

if [ -n "${BD_LOADGEN+x}" ]; then
	# `make bench-serve`: the load generator instead of one prompt
	say "loadgen $BD_LOADGEN"
	# shellcheck disable=SC2086
	"$BIN/loadgen" --router "$FRONT_EP" --pool "$POOL_EP" $BD_LOADGEN || fail "loadgen"
else
	say "prompt: $PROMPT"
	printf '\n'
	"$BIN/bdfp4" client --router "$FRONT_EP" --max-tokens "$MAX_TOKENS" --stats "$PROMPT" ||
		fail "the request failed"
	printf '\n'
fi

say "kvpoolctl stats"
"$BIN/kvpoolctl" --no-config --endpoint "$POOL_EP" stats || fail "kvpoolctl stats"

say "stopping (SIGTERM)"
stop router "$ROUTER_PID"
ROUTER_PID=
stop "workerd rank 0" "$W0_PID"
W0_PID=
stop "workerd rank 1" "$W1_PID"
W1_PID=
stop kvpoold "$POOL_PID"
POOL_PID=
say "done"
