#!/bin/sh
# check-layers.sh — the include rule of lib/README.md, checked on the sources:
#   - lib/<layer>/ includes only its own layer and the layers below it, always spelled
#     "layer/bd_name.h" (the layers, bottom first: base quant formats model pool serve; cuda
#     above them all);
#   - lib/cuda/ is the only lib/ folder that includes kernels/ headers;
#   - kernels/ includes no lib/ header outside quant/;
#   - generated protocol headers: kvpool.pb-c.h in the pool layer, serve.pb-c.h in serve.
# Prints each violation as file:line: text and exits 1 when there is one.
set -u
cd "$(dirname "$0")/.." || exit 2
order="base quant formats model pool serve cuda"
kernel_headers=$(cd kernels && ls *.h *.cuh 2>/dev/null)
bad=0
list=$(mktemp) || exit 2
trap 'rm -f "$list"' EXIT

rank() { # position of a layer in $order, or 99
	i=0
	for l in $order; do
		[ "$l" = "$1" ] && { echo $i; return; }
		i=$((i + 1))
	done
	echo 99
}

say() { echo "$1: $2"; bad=1; }

is_kernel_header() {
	for k in $kernel_headers; do [ "$k" = "$1" ] && return 0; done
	return 1
}

for layer in $order; do
	[ -d "lib/$layer" ] || continue
	r=$(rank "$layer")
	for f in lib/$layer/*.c lib/$layer/*.h; do
		[ -f "$f" ] || continue
		grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
			sed 's/^\([0-9]*\):.*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1 \2/' >"$list"
		while read -r line inc; do
			case "$inc" in
			*/*)
				dep=${inc%%/*}
				dr=$(rank "$dep")
				if [ "$dr" = 99 ]; then
					say "$f:$line" "\"$inc\" is not a lib/ layer"
				elif [ "$dr" -gt "$r" ]; then
					say "$f:$line" "$layer includes the higher layer $dep (\"$inc\")"
				elif [ ! -f "lib/$inc" ]; then
					say "$f:$line" "\"$inc\" does not exist"
				fi
				;;
			kvpool.pb-c.h)
				[ "$r" -ge "$(rank pool)" ] || say "$f:$line" "kvpool.pb-c.h below the pool layer" ;;
			serve.pb-c.h)
				[ "$r" -ge "$(rank serve)" ] || say "$f:$line" "serve.pb-c.h below the serve layer" ;;
			*)
				if is_kernel_header "$inc"; then
					[ "$layer" = cuda ] || say "$f:$line" "only lib/cuda includes kernels/ (\"$inc\")"
				else
					say "$f:$line" "\"$inc\": lib/ headers are included as \"layer/bd_name.h\""
				fi
				;;
			esac
		done <"$list"
	done
done

for f in kernels/*; do
	grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
		sed 's/^\([0-9]*\):.*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1 \2/' >"$list"
	while read -r line inc; do
		case "$inc" in
		quant/*) [ -f "lib/$inc" ] || say "$f:$line" "\"$inc\" does not exist" ;;
		*/*) say "$f:$line" "kernels/ includes only the quant layer of lib/ (\"$inc\")" ;;
		*) is_kernel_header "$inc" || say "$f:$line" "\"$inc\" is not a kernels/ header" ;;
		esac
	done <"$list"
done

[ -z "$(ls lib/*.c lib/*.h 2>/dev/null)" ] || say lib "a source stands directly in lib/: $(ls lib/*.c lib/*.h 2>/dev/null | tr '\n' ' ')"
[ $bad = 0 ] && echo "check-layers: lib/ layers and kernels/ includes as lib/README.md says"
exit $bad
