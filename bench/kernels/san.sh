# san.sh — compute-sanitizer memcheck and racecheck on `gpu_check --small`, and the FP4 decode
# kernels' registers, shared by run.sh, ab.sh and speed.sh (sourced, POSIX sh functions; they
# read $OUT, the log folder, and $CO, cuobjdump, when set).
#
#   san_run BIN PREFIX SECONDS   both tools on BIN --small, each under a SECONDS time limit:
#                                logs $OUT/PREFIX$tool.log, exit statuses $OUT/PREFIX$tool.rc
#   san_report PREFIX LINES      one line per tool (its exit status) and the last LINES lines of
#                                its log; returns 1 when a tool failed or left no status
#   fp4_regs NAME OBJ            one line "  NAME: <D,MODE,NV|MX>:registers,local-bytes ..." for
#                                every fp4_decode_kernel in OBJ (cuobjdump --dump-resource-usage;
#                                a trailing p: its persistent form)

san_run() {
	san_bin=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
	for tool in memcheck racecheck; do
		timeout "$3" "$san_bin" --tool $tool --error-exitcode 1 "$1" --small \
			>"$OUT/$2$tool.log" 2>&1
		echo $? >"$OUT/$2$tool.rc"
	done
}

san_report() {
	san_rc=0
	for tool in memcheck racecheck; do
		r=$(cat "$OUT/$1$tool.rc" 2>/dev/null || echo missing)
		echo "compute-sanitizer $tool --small: exit $r"
		tail -"$2" "$OUT/$1$tool.log"
		[ "$r" = 0 ] || san_rc=1
	done
	return $san_rc
}

fp4_regs() {
	"${CO:-cuobjdump}" --dump-resource-usage "$2" 2>/dev/null |
		awk -v s="$1" '/Function .*fp4_decode_kernel/ { match($0, /ILi[0-9]+ELi[0-9]ELb[01]/)
				k = substr($0, RSTART, RLENGTH); gsub(/ILi|ELi|ELb/, " ", k); split(k, a, " ")
				name = "<" a[1] "," a[2] "," (a[3] == 1 ? "MX" : "NV") ">"
				if (index($0, "persist")) name = name "p"
				next }
			name != "" { out = out " " name ":" $1 "," $4; name = "" }
			END { print "  " s ":" out }'
}
