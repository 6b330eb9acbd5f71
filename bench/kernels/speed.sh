#!/bin/bash
# speed.sh — one device call (one H200, 16 cores, under 9 minutes) that checks and times the
# decode kernels' build-flag variants against the default build (bench/KERNELS-NOTES.md):
#   1. builds gpu_check and bench_kernels for sm_90a only: "old" (the default flags) in full,
#      then each variant as a copy of old's build directory with kernels/decode_sm90.o rebuilt
#      under its flags (the BD_V9_*, BD_PERSIST and BD_PLAN_TAIL switches appear in no other file);
#   2. static SASS of the page loops and the registers of every build (when cuobjdump is there);
#   3. gpu_check on every variant: in full on the last one, --quick on the
#      others, compute-sanitizer memcheck and racecheck --small on the last one beside it; a
#      variant that fails is reported and not timed;
#   4. bench_kernels (CUDA graph replays, median) at B 1, 8, 64, N 8K, 32K, 128K, Hkv 8 and 4,
#      for bitdecoding-nvfp4, nvfp4-base and bitdecoding-mxfp4, in the order old, new, old, new
#      (new: the last variant), then the other variants once at B 1 and 64, N 128K, Hkv 8;
#   5. prints the table last: the old and new means, new/old, and new's check error.
#
#   bench/kernels/speed.sh            from the repository root; logs under $OUT (default ./out)
# Environment: SPEED_BUILD (build directory prefix, default build-speed), SPEED_VARIANTS
# (space-separated name=flags, comma for a space inside flags; default below), SPEED_REPS
# (graph replays per point, default 10), SPEED_SAN=0 skips the sanitizers, BD_GPU_CAPTURE (the
# real-KV file for gpu_check, as in run.sh). $OUT gets at most 6 files (the device returns 8):
# speed.log (this transcript), build.log, check.log, bench.log, sass.txt, table.md. Exit
# status: non-zero when a build, a check, a sanitizer or a benchmark run failed.
set -u
. "$(dirname "$0")/san.sh"
OUT=${OUT:-out}
mkdir -p "$OUT"
main() {
PFX=${SPEED_BUILD:-build-speed}
VARIANTS=${SPEED_VARIANTS:-v8=-DBD_V9_LDSM=0,-DBD_V9_SOFT=0,-DBD_V9_MXK=0}
REPS=${SPEED_REPS:-10}
SAN=${SPEED_SAN:-1}
CFGS=bitdecoding-nvfp4,nvfp4-base,bitdecoding-mxfp4
T0=$(date +%s)
DEADLINE=$((T0 + 530))
rc=0
step() { echo "=== $1 (+$(($(date +%s) - T0)) s)"; }
left() { echo $((DEADLINE - $(date +%s))); }
names=
for v in $VARIANTS; do names="$names ${v%%=*}"; done
last=${names##* }

step "build old, then$names (sm_90a)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -2
nvcc --version | tail -1
bins() { echo "$1/bin/gpu_check $1/bin/bench_kernels"; }
# shellcheck disable=SC2046
timeout 300 make --no-print-directory BUILD="$PFX-old" GENCODE_BW= -j"$(nproc)" $(bins "$PFX-old") \
	>"$OUT/build.log" 2>&1 || { echo "BUILD old FAILED"; grep -E "error" "$OUT/build.log" | head -20; exit 1; }
pids=
for v in $VARIANTS; do
	n=${v%%=*} f=${v#*=}
	rm -rf "$PFX-$n"
	cp -a "$PFX-old" "$PFX-$n"
	rm -f "$PFX-$n/kernels/decode_sm90.o"
	# shellcheck disable=SC2046
	timeout 240 make --no-print-directory BUILD="$PFX-$n" GENCODE_BW= EXTRA_NVCCFLAGS="${f//,/ }" \
		$(bins "$PFX-$n") >"$OUT/build_$n.tmp" 2>&1 &
	pids="$pids $!"
done
i=0
for p in $pids; do
	i=$((i + 1))
	n=$(echo "$names" | xargs | cut -d' ' -f$i)
	wait "$p" || { echo "BUILD $n FAILED"; grep -E "error" "$OUT/build_$n.tmp" | head -20; rc=1; bad_build="${bad_build:-} $n"; }
	{ echo "--- build $n"; cat "$OUT/build_$n.tmp"; } >>"$OUT/build.log"
	rm -f "$OUT/build_$n.tmp"
done

step "static SASS of the page loops, registers (<D,MODE,NV|MX>: registers, local bytes)"
CO=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
if [ -x "$CO" ] || command -v "$CO" >/dev/null 2>&1; then
	sass=
	: >"$OUT/sass.txt"
	for n in old $names; do
		"$CO" --dump-sass "$PFX-$n/kernels/decode_sm90.o" >"$PFX-$n.sass" 2>/dev/null && sass="$sass $PFX-$n.sass"
		fp4_regs "$n" "$PFX-$n/kernels/decode_sm90.o" >>"$OUT/sass.txt"
	done
	cat "$OUT/sass.txt"
	echo "page loop, static SASS per warp per page, old/$(echo "$names" | xargs | tr ' ' '/'):" | tee -a "$OUT/sass.txt"
	# shellcheck disable=SC2086
	python3 bench/kernels/sass_loop.py $sass 2>&1 | tee -a "$OUT/sass.txt" | grep -E "kernel|<128"
	rm -f $sass
else
	echo "no cuobjdump: skipped"
fi

cap=${BD_GPU_CAPTURE:-$PFX-old/gpu-data/smollm2_kv.bin}
[ -f "$cap" ] && export BD_GPU_CAPTURE="$cap"
step "gpu_check: $last in full${BD_GPU_CAPTURE:+ (real KV: $BD_GPU_CAPTURE)}, the others --quick"
: >"$OUT/check.log"
san_pid=
if [ "$SAN" = 1 ] && [ -x "$PFX-$last/bin/gpu_check" ]; then
	san_run "$PFX-$last/bin/gpu_check" "speed_san_" 150 &
	san_pid=$!
fi
ok=
for n in $names; do
	case " ${bad_build:-} " in *" $n "*) continue ;; esac
	arg=--quick
	[ "$n" = "$last" ] && arg=
	# shellcheck disable=SC2086
	timeout 240 "$PFX-$n/bin/gpu_check" $arg >"$OUT/check_$n.tmp" 2>&1
	r=$?
	{ echo "--- gpu_check $n $arg (exit $r)"; cat "$OUT/check_$n.tmp"; } >>"$OUT/check.log"
	echo "  $n${arg:+ $arg}: $(tail -1 "$OUT/check_$n.tmp")"
	grep -E "FAIL" "$OUT/check_$n.tmp" | head -10
	rm -f "$OUT/check_$n.tmp"
	if [ "$r" = 0 ]; then ok="$ok $n"; else echo "  $n FAILED gpu_check: not timed"; rc=1; fi
done
if [ -n "$san_pid" ]; then
	wait "$san_pid"
	san_report "speed_san_" 2 | tee -a "$OUT/check.log" | grep -E "compute-sanitizer|ERROR|Hazard" || true
	san_report "speed_san_" 2 >/dev/null || { echo "  sanitizers on $last FAILED"; rc=1; ok=$(echo " $ok " | sed "s/ $last / /"); }
	rm -f "$OUT"/speed_san_*
fi

# bench NAME HKV PASS [more bench_kernels arguments]: one run into bench.log, rows tagged
: >"$OUT/bench.log"
bench() {
	local n=$1 hkv=$2 pass=$3
	shift 3
	timeout 150 "$PFX-$n/bin/bench_kernels" --hkv "$hkv" --cfg "$CFGS" --reps "$REPS" "$@" >"$OUT/bench.tmp" 2>&1
	local r=$?
	grep -E "^\| [a-z]" "$OUT/bench.tmp" | grep -v "^| kernel" | sed "s/^/$n $hkv $pass /" >>"$OUT/bench.log"
	[ "$r" = 0 ] || { echo "  bench_kernels $n hkv $hkv FAILED (exit $r)"; tail -3 "$OUT/bench.tmp"; rc=1; }
	rm -f "$OUT/bench.tmp"
}
new=$last
case " $ok " in *" $new "*) ;; *) new= ;; esac
step "bench: old${new:+, $new}, old${new:+, $new} at B 1,8,64, N 8K,32K,128K, Hkv 8 and 4"
for pass in 1 2; do
	for n in old $new; do
		for hkv in 8 4; do
			if [ "$(left)" -lt 40 ]; then echo "  out of time: $n hkv $hkv pass $pass skipped"; continue; fi
			val=
			[ "$pass" = 2 ] && val=--novalidate
			# shellcheck disable=SC2086
			bench "$n" "$hkv" "$pass" --B 1,8,64 --N 8192,32768,131072 $val
		done
	done
done
step "bench: each variant once at B 1,64, N 128K, Hkv 8"
for n in old $ok; do
	[ "$(left)" -lt 15 ] && { echo "  out of time: $n skipped"; continue; }
	bench "$n" 8 3 --B 1,64 --N 131072 --novalidate
done

step "table (time per decode step, µs; old and $new the means of passes 1 and 2)"
{
	echo "| cfg | Hkv | B | N | old | ${new:-new} | new/old | check rel err (new) |"
	echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
	awk -v new="$new" '
		{ n = $1; h = $2; p = $3; split($0, f, "|"); c = f[2]; gsub(/ /, "", c)
		  B = f[3] + 0; N = f[4] + 0; t = f[6] + 0; e = f[10]; gsub(/^ +| +$/, "", e)
		  k = c "|" h "|" B "|" N
		  if (p <= 2) { s[n, k] += t; m[n, k]++ } else { x[n, k] = t }
		  if (p == 1 && n == new) err[k] = e
		  if (!(k in seen)) { seen[k] = 1; order[++K] = k } }
		END {
			for (i = 1; i <= K; i++) {
				k = order[i]; split(k, a, "|")
				o = m["old", k] ? s["old", k] / m["old", k] : 0
				w = m[new, k] ? s[new, k] / m[new, k] : 0
				printf "| %s | %s | %s | %s | %.1f | %s | %s | %s |\n", a[1], a[2], a[3], a[4], o,
					w ? sprintf("%.1f", w) : "-", (o > 0 && w > 0) ? sprintf("%.3f", w / o) : "-",
					(k in err) ? err[k] : "-"
			}
			print ""
			print "single runs at Hkv 8, N 128K (pass 3), µs:"
			for (q in x) { split(q, b, SUBSEP); split(b[2], a, "|")
				printf "  %-4s %-18s B %2s: %.1f\n", b[1], a[1], a[3], x[q] }
		}' "$OUT/bench.log"
} | tee "$OUT/table.md"
step "done rc=$rc"
return $rc
}

main 2>&1 | tee "$OUT/speed.log"
exit "${PIPESTATUS[0]}"
