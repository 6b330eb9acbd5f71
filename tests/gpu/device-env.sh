# device-env.sh — SOURCE this on the GPU machine, from the project root:
#
#     source tests/gpu/device-env.sh [DEBS_DIR [ROOT_DIR]]
#
# The GPU machine lacks ZeroMQ, protobuf-c, inih, libsystemd, Criterion, PCRE2, OpenBLAS and
# jansson. The run carries them as Debian packages in .deps/debs (fetched on the build machine by
# shared/device/fetch-debs.sh); this unpacks every .deb into .deps/root once (dpkg -x, or ar+tar
# where dpkg is missing) and points the toolchain at it: CPATH, LIBRARY_PATH, LD_LIBRARY_PATH,
# PATH and PKG_CONFIG_PATH. The .pc files say prefix=/usr; their copies under .deps/root are
# rewritten to the unpacked prefix (a sysroot would also rewrite the system's own .pc files)
# and lose their Requires.private lines (static linking only; they name .pc files not shipped).
# The unpacking is redone when the set of .debs or the location of the tree changes.
# Sourced: it never exits the caller's shell; it returns 1 with a message on failure.

bd_denv_main() {
	local debs=${1:-.deps/debs} root=${2:-.deps/root}
	local R L stamp want f pc
	local -a list

	if [ ! -d "$debs" ]; then
		echo "device-env: no $debs (carry .deps in the run)" >&2
		return 1
	fi
	list=("$debs"/*.deb)
	if [ ! -e "${list[0]}" ]; then
		echo "device-env: no .deb in $debs" >&2
		return 1
	fi
	mkdir -p "$root" || return 1
	R=$(cd "$root" && pwd) || return 1
	L=$R/usr/lib/x86_64-linux-gnu
	stamp=$R/.unpacked
	want=$(printf '%s\n' "$R" "${list[@]##*/}")
	if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
		find "$R" -mindepth 1 -delete || return 1
		for f in "${list[@]}"; do
			if command -v dpkg >/dev/null; then
				dpkg -x "$f" "$R" || { echo "device-env: dpkg -x $f failed" >&2; return 1; }
			else
				# a .deb is an ar archive holding data.tar.{xz,zst,gz}
				local tmp abs
				abs=$(cd "$(dirname "$f")" && pwd)/$(basename "$f")
				tmp=$(mktemp -d) || return 1
				(cd "$tmp" && ar x "$abs") && tar -xf "$tmp"/data.tar.* -C "$R" ||
					{ rm -rf "$tmp"; echo "device-env: unpacking $f failed" >&2; return 1; }
				rm -rf "$tmp"
			fi
		done
		# prefix=/usr, libdir=/usr/lib/... and friends: point them into the tree; drop
		# Requires.private (static linking only; they name .pc files not shipped here)
		for pc in $(find "$R" -name '*.pc'); do
			sed -i -E -e "s#^([A-Za-z_]+)=/usr(/|\$)#\\1=$R/usr\\2#" \
				-e '/^Requires\.private:/d' "$pc" || return 1
		done
		printf '%s\n' "$want" >"$stamp"
	fi
	export CPATH=$R/usr/include:$R/usr/include/x86_64-linux-gnu:$R/usr/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}
	# OpenBLAS lives in openblas-pthread/ (Debian's alternatives symlinks are not unpacked)
	export LIBRARY_PATH=$L:$L/openblas-pthread:$R/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
	export LD_LIBRARY_PATH=$L:$L/openblas-pthread:$R/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
	export PATH=$R/usr/bin:$PATH
	export PKG_CONFIG_PATH=$L/pkgconfig:$R/usr/share/pkgconfig:$L/openblas-pthread/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
	# what the unpacked libraries need from the system and it lacks (carry those .debs too)
	for f in libzmq.so.5 libprotobuf-c.so.1 libinih.so.1 libsystemd.so.0 libjansson.so.4 \
		libpcre2-8.so.0 openblas-pthread/libopenblas.so.0 libprotoc.so.32; do
		[ -e "$L/$f" ] || continue
		pc=$(ldd "$L/$f" 2>/dev/null | grep 'not found' |
			awk '{print $1}' | tr '\n' ' ')
		[ -z "$pc" ] || echo "device-env: warning: ${f##*/} needs $pc(missing here)" >&2
	done
	if ! command -v pkg-config >/dev/null; then
		echo "device-env: $((${#list[@]})) packages under $R; no pkg-config here (the" \
			"Makefile falls back to -lzmq -lprotobuf-c -linih -lsystemd)"
		return 0
	fi
	if ! pkg-config --exists libzmq libprotobuf-c inih libsystemd; then
		echo "device-env: pkg-config does not find libzmq libprotobuf-c inih libsystemd" \
			"under $R" >&2
		return 1
	fi
	echo "device-env: $((${#list[@]})) packages under $R;" \
		"pool libs: $(pkg-config --libs libzmq libprotobuf-c inih libsystemd)"
}

bd_denv_main "$@"
bd_denv_rc=$?
unset -f bd_denv_main
return $bd_denv_rc 2>/dev/null || true
