#!/bin/sh
# run-local.sh — the main job of `make run`: the whole serving system on this machine without
# systemd. Starts kvpoold, the router and the tensor-parallel workers in a private runtime
# directory, waits until the router serves, streams the answer to PROMPT with `bdfp4 client`,
# prints `kvpoolctl stats`, stops every daemon with SIGTERM and checks that each exits 0.
#
#   deploy/run-local.sh BIN_DIR MODEL "PROMPT" [RUN_DIR]
#
# RUN_DIR (default $XDG_RUNTIME_DIR, else build/run) holds a fresh directory per run with the
# sockets and the daemons' logs; it is removed at the end unless BD_KEEP_RUN=1.
# BD_MAX_TOKENS (default 200) and BD_KV (default bitdecoding-nvfp4) tune the run; with
# BD_LOADGEN="ARGS" set, bench/loadgen runs with ARGS instead of the prompt (make bench-serve);
# with BD_RUN_CMD="COMMAND" set, COMMAND runs instead (sh -c), with BD_FRONT_EP, BD_HTTP_URL
# (the router's HTTP API, e.g. http://127.0.0.1:PORT), BD_POOL_EP, BD_RUN_DIR (the logs),
# BD_WORKER_PIDS (the workers' first pids), BD_WORKER_PIDFILES (files that hold each rank's
# current pid) and BD_POOL_PIDFILE (kvpoold's) exported (bench/serve_gpu.sh, loadgen --fault).
# The HTTP listener takes BD_HTTP (HOST:PORT, default a free loopback port).
#
# Each worker runs as systemd's Restart=on-failure with RestartSec=1 runs it: a worker that ends
# other than with exit 0 (kill -9, a crash, exit 1 when kvpoold went away) is started again
# after a second, and the router resumes its requests when the group forms again. kvpoold runs
# as kvpoold.service runs it (Restart=on-failure, its fd store): under fdstore-run
# (deploy/fdstore_run.c), which keeps the arena and state fds it stores and starts it again on
# them 100 ms after it ends other than with exit 0, so its pages survive its restart.
#
# BD_BACKEND=cpu (default) or cuda (`make run BACKEND=cuda`): kvpoold's backend. On cuda the
# pool takes BD_GPU_MEM_FRACTION (default 0.5) of each GPU, the rest is the model's; rank r runs
# on GPU r, so TP = BD_TP (default: the GPUs, at most 2) must not exceed the GPUs (NCCL needs a
# GPU per rank). On the CPU, TP = BD_TP (default 2).
# Serving benchmarks (cuda): BD_RANDOM_WEIGHTS=PRESET serves seeded random weights of that shape
# (MODEL is then unused: no tokenizer, token ids only), BD_SYNTHETIC_PREFILL=1 fills prompts with
# synthetic KV; BD_MAX_SEQ_LEN, BD_SLOTS, BD_MAX_BATCH, BD_MAX_PREFILL, BD_ROUTER_ARGS and
# BD_WORKER_ARGS tune the system.
set -u

BIN=$(cd "$1" && pwd)
MODEL=$2
PROMPT=$3
BASE=${4:-${XDG_RUNTIME_DIR:-build/run}}
MAX_TOKENS=${BD_MAX_TOKENS:-200}
KV=${BD_KV:-bitdecoding-nvfp4}
BACKEND=${BD_BACKEND:-cpu}
PRESET=${BD_RANDOM_WEIGHTS:-}

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

POOL_PID= ROUTER_PID= W0_PID= W1_PID= S0_PID= S1_PID=
say() { printf '== %s\n' "$*" >&2; }

show_logs() {
	for f in "$RT"/*.log; do
		[ -s "$f" ] || continue
		printf -- '--- %s (last lines)\n' "$(basename "$f")" >&2
		tail -n 15 "$f" >&2
	done
}

cleanup() {
	: >"$RT/stopping"
	for p in $ROUTER_PID $S0_PID $S1_PID $POOL_PID; do
		kill -KILL "$p" 2>/dev/null
	done
	for f in "$RT"/workerd-*.pid; do
		[ -s "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null
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

# Waits up to 30 s for child $2 (named $1 in messages), sent SIGTERM, to end; fails unless its
# exit status is 0.
reap() {
	name=$1 pid=$2
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

# Sends SIGTERM and waits up to 30 s; fails unless the exit status is 0.
stop() {
	kill -TERM "$2" 2>/dev/null || fail "$1 (pid $2) was already gone"
	reap "$1" "$2"
}

[ -n "$PRESET" ] || [ -r "$MODEL" ] || fail "no model at $MODEL (make model)"
for b in kvpoold kvpoolctl routerd workerd bdfp4 fdstore-run ${BD_LOADGEN+loadgen}; do
	[ -x "$BIN/$b" ] || fail "no $BIN/$b (make all)"
done
export OPENBLAS_NUM_THREADS=1

# the model's KV geometry: the embedded SmolLM2-135M, or the preset's
case "$PRESET" in
"") GEOM="--layers 30 --kv-heads 3 --head-dim 64" ;;
qwen3-4b) GEOM="--layers 36 --kv-heads 8 --head-dim 128" ;;
qwen3-30b-a3b-attn) GEOM="--layers 48 --kv-heads 4 --head-dim 128" ;;
*) fail "BD_RANDOM_WEIGHTS=$PRESET: no such preset (qwen3-4b, qwen3-30b-a3b-attn)" ;;
esac
MODEL_ARGS="--model $MODEL"
[ -n "$PRESET" ] && MODEL_ARGS="--random-weights $PRESET"
MAX_SEQ=${BD_MAX_SEQ_LEN:-8192}
SLOTS=${BD_SLOTS:-16}
WARGS=
case "$BACKEND" in
cpu)
	TP=${BD_TP:-2}
	[ -z "$PRESET" ] || fail "BD_RANDOM_WEIGHTS needs BD_BACKEND=cuda"
	MEM="--memory-bytes 256M"
	;;
cuda)
	NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
	[ "$NGPU" -ge 1 ] 2>/dev/null || fail "BD_BACKEND=cuda: no NVIDIA GPU here (nvidia-smi -L lists none)"
	if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
		n=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
		[ "$n" -lt "$NGPU" ] && NGPU=$n
	fi
	DEF_TP=$NGPU
	[ "$DEF_TP" -gt 2 ] && DEF_TP=2
	TP=${BD_TP:-$DEF_TP}
	[ "$TP" -le "$NGPU" ] ||
		fail "TP=$TP on $NGPU GPU(s): each rank needs its own GPU (NCCL cannot run two ranks on one device); set BD_TP=$NGPU"
	MEM="--memory-bytes 0 --gpu-memory-fraction ${BD_GPU_MEM_FRACTION:-0.5}"
	WARGS="--max-batch ${BD_MAX_BATCH:-64} --max-prefill ${BD_MAX_PREFILL:-8192}"
	[ "${BD_SYNTHETIC_PREFILL:-0}" = 1 ] && WARGS="$WARGS --synthetic-prefill"
	;;
*) fail "BD_BACKEND=$BACKEND: cpu or cuda" ;;
esac
case "$TP" in 1 | 2) ;; *) fail "BD_TP=$TP: 1 or 2" ;; esac

say "runtime directory $RT"
say "starting kvpoold ($BACKEND backend, TP=$TP, $KV${PRESET:+, $PRESET})"
# POOL_PID is fdstore-run's: SIGTERM reaches kvpoold through it, and its status is kvpoold's
# shellcheck disable=SC2086
"$BIN/fdstore-run" "$RT/kvpoold.pid" "$RT/kvpoold-notify.sock" "$RT/kvpoold.log" -- \
	"$BIN/kvpoold" --no-config --socket "$POOL_SOCK" --endpoint "$POOL_EP" --backend "$BACKEND" \
	--tp "$TP" --kv-config "$KV" $GEOM --max-seq-len "$MAX_SEQ" --slots "$SLOTS" $MEM \
	2>>"$RT/kvpoold.log" &
POOL_PID=$!
export BD_POOL_PIDFILE="$RT/kvpoold.pid"
i=0
until "$BIN/kvpoolctl" --no-config --endpoint "$POOL_EP" --timeout 500 stats >/dev/null 2>&1; do
	alive $POOL_PID || fail "kvpoold exited"
	i=$((i + 1))
	[ $i -lt 100 ] || fail "kvpoold did not answer within 50 s"
	sleep 0.5
done

say "starting the router"
RMAX=
[ "$BACKEND" = cuda ] && RMAX="--max-batch ${BD_MAX_BATCH:-64}"
# shellcheck disable=SC2086
"$BIN/routerd" --no-config --frontend "$FRONT_EP" --workers "$WORKERS_EP" --pool "$POOL_EP" \
	--http "${BD_HTTP:-127.0.0.1:0}" $MODEL_ARGS --tp "$TP" $RMAX ${BD_ROUTER_ARGS:-} \
	2>"$RT/routerd.log" &
ROUTER_PID=$!

# Runs workerd rank $1 as Restart=on-failure (RestartSec=1) would; its current pid is in
# $RT/workerd-$1.pid. Ends with the worker's status once it exits 0 or the run is stopping.
supervise() {
	r=$1
	while :; do
		# shellcheck disable=SC2086
		"$BIN/workerd" --no-config --rank "$r" --tp "$TP" $MODEL_ARGS \
			--pool-socket "$POOL_SOCK" --router "$WORKERS_EP" --allreduce-dir "$RT" \
			--threads 1 $WARGS ${BD_WORKER_ARGS:-} 2>>"$RT/workerd-$r.log" &
		echo $! >"$RT/workerd-$r.pid.tmp" && mv "$RT/workerd-$r.pid.tmp" "$RT/workerd-$r.pid"
		wait $!
		rc=$?
		[ $rc -eq 0 ] && exit 0
		[ -e "$RT/stopping" ] && exit $rc
		printf '== run-local.sh: workerd rank %s ended with status %s: restarting in 1 s\n' \
			"$r" "$rc" >>"$RT/workerd-$r.log"
		sleep 1
	done
}

RANKS=0
[ "$TP" = 2 ] && RANKS="0 1"
say "starting workerd rank(s) $RANKS (restarted on failure)"
PIDFILES=
for r in $RANKS; do
	supervise "$r" &
	eval S${r}_PID=$!
	PIDFILES="$PIDFILES $RT/workerd-$r.pid"
	i=0
	until [ -s "$RT/workerd-$r.pid" ]; do
		i=$((i + 1))
		[ $i -lt 100 ] || fail "workerd rank $r did not start"
		sleep 0.1
	done
	eval W${r}_PID="$(cat "$RT/workerd-$r.pid")"
done

# the router answers health as soon as it listens; --wait-ready polls until it serves
sleep 0.5
for p in $POOL_PID $ROUTER_PID $W0_PID $W1_PID; do
	alive "$p" || fail "a daemon exited at start"
done
"$BIN/bdfp4" client --router "$FRONT_EP" --wait-ready 300 --health >/dev/null ||
	fail "the router did not start serving"
"$BIN/bdfp4" client --router "$FRONT_EP" --info
# the router logs the URL it listens on (the port is the one the kernel picked)
HTTP_URL=$(sed -n 's/.*http: listening on \(http:[^ ]*\).*/\1/p' "$RT/routerd.log" | head -n 1)
[ -n "$HTTP_URL" ] || fail "the router logged no HTTP address"
say "HTTP API at $HTTP_URL/v1 (health $HTTP_URL/health, metrics $HTTP_URL/metrics)"

if [ -n "${BD_RUN_CMD:-}" ]; then
	say "running: $BD_RUN_CMD"
	BD_FRONT_EP=$FRONT_EP BD_HTTP_URL=$HTTP_URL BD_POOL_EP=$POOL_EP BD_RUN_DIR=$RT \
		BD_WORKER_PIDS="$W0_PID $W1_PID" BD_WORKER_PIDFILES="${PIDFILES# }" \
		sh -c "$BD_RUN_CMD" || fail "$BD_RUN_CMD"
elif [ -n "${BD_LOADGEN+x}" ]; then
	# `make bench-serve`: the load generator instead of one prompt
	say "loadgen $BD_LOADGEN"
	# shellcheck disable=SC2086
	BD_WORKER_PIDFILES="${PIDFILES# }" \
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

# Stops workerd rank $1 with SIGTERM (its current pid) and waits for its supervisor $2, whose
# status is the worker's; fails unless 0.
stop_worker() {
	r=$1 spid=$2
	# it may have gone on its own already: the router's Shutdown ends it with exit 0
	kill -TERM "$(cat "$RT/workerd-$r.pid")" 2>/dev/null
	reap "workerd rank $r" "$spid"
}

say "stopping (SIGTERM)"
: >"$RT/stopping"
stop router "$ROUTER_PID"
ROUTER_PID=
stop_worker 0 "$S0_PID"
S0_PID=
if [ -n "$S1_PID" ]; then
	stop_worker 1 "$S1_PID"
	S1_PID=
fi
stop kvpoold "$POOL_PID"
POOL_PID=
say "done"
