#!/bin/sh
# check-calls.sh BUILD — no circles between a daemon's files (lib/README.md): within router/ and
# workerd/, read from the built objects (nm), no file calls into main.c, and no two files call
# each other (A uses a symbol B defines and B one that A defines). main.c may call everyone.
# Prints each violation and exits 1 when there is one.
set -u
build=${1:-build}
bad=0
tmp=$(mktemp -d) || exit 2
trap 'rm -rf "$tmp"' EXIT

for d in router workerd; do
	objs=$(ls "$build/$d"/*.o 2>/dev/null) || { echo "check-calls: no objects in $build/$d (build first)"; exit 2; }
	for o in $objs; do
		f=$(basename "$o" .o)
		nm --defined-only -g "$o" | awk '{print $3}' | sort -u >"$tmp/$f.def"
		nm -u "$o" | awk '{print $2}' | sort -u >"$tmp/$f.und"
	done
	: >"$tmp/edges"
	for o in $objs; do
		a=$(basename "$o" .o)
		for p in $objs; do
			b=$(basename "$p" .o)
			[ "$a" = "$b" ] && continue
			if [ -n "$(comm -12 "$tmp/$a.und" "$tmp/$b.def")" ]; then
				echo "$a $b" >>"$tmp/edges"
			fi
		done
	done
	while read -r a b; do
		if [ "$b" = main ]; then
			echo "$d/$a.c calls into $d/main.c: $(comm -12 "$tmp/$a.und" "$tmp/$b.def" | tr '\n' ' ')"
			bad=1
		elif [ "$a" != main ] && grep -qx "$b $a" "$tmp/edges" && [ "$a" \< "$b" ]; then
			echo "$d/$a.c and $d/$b.c call each other: $a -> $(comm -12 "$tmp/$a.und" "$tmp/$b.def" | tr '\n' ' ')/ $b -> $(comm -12 "$tmp/$b.und" "$tmp/$a.def" | tr '\n' ' ')"
			bad=1
		fi
	done <"$tmp/edges"
	rm -f "$tmp"/*.def "$tmp"/*.und
done
[ $bad = 0 ] && echo "check-calls: no circles in router/ and workerd/"
exit $bad
