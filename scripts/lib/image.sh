# Sourced by scripts/image-test.sh and scripts/build-agent-image.sh: the local
# debian:bookworm-slim base (bootstrapped once with debootstrap and cached as a tarball), the
# podman store both build the Dockerfile in, and the build secrets that give pip inside the
# build this machine's package index settings. The sourcing script defines log and die.
# dpkg-query's and podman's formats below are their own, not the shell's.
# shellcheck shell=bash disable=SC2016

TOP="${COZYEBPF_IMAGE_TEST_DIR:-/var/lib/cozyebpf-image-test}"
MIRROR="${COZYEBPF_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
BASE_REF=localhost/debian:bookworm-slim
BASE_TAR="$TOP/base/debian-$SUITE-slim.tar"
STORE="$TOP/storage"
RUNROOT=/run/cozyebpf-image-test
PODMAN=(podman --root "$STORE" --runroot "$RUNROOT" --storage-driver vfs --events-backend file)
podman_() { "${PODMAN[@]}" "$@"; }
#: a debootstrap root being made (the sourcing script's clean-up removes it: see image_cleanup)
BOOTSTRAP_DIR=""

# As debuerreotype makes the official slim variant: no docs, man pages or
# locales (dpkg excludes them from later installs too), apt's docker configs,
# deb822 sources with bookworm-updates and bookworm-security.
slim_rootfs() {
	local root=$1
	cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<-'EOF'
		# as Debian's official slim images
		path-exclude /usr/share/doc/*
		path-include /usr/share/doc/*/copyright
		path-exclude /usr/share/groff/*
		path-exclude /usr/share/info/*
		path-exclude /usr/share/linda/*
		path-exclude /usr/share/lintian/overrides/*
		path-exclude /usr/share/locale/*
		path-exclude /usr/share/man/*
	EOF
	find "$root/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
	find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
	rm -rf "$root"/usr/share/{groff,info,linda,locale,man}/* "$root"/usr/share/lintian/overrides/*
	cat >"$root/etc/apt/apt.conf.d/docker-clean" <<-'EOF'
		DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
		APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
		Dir::Cache::pkgcache "";
		Dir::Cache::srcpkgcache "";
	EOF
	echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
	echo 'Acquire::GzipIndexes "true";' >"$root/etc/apt/apt.conf.d/docker-gzip-indexes"
	echo 'Apt::AutoRemove::SuggestsImportant "false";' >"$root/etc/apt/apt.conf.d/docker-autoremove-suggests"
	rm -f "$root/etc/apt/sources.list"
	cat >"$root/etc/apt/sources.list.d/debian.sources" <<-EOF
		Types: deb
		URIs: $MIRROR
		Suites: $SUITE $SUITE-updates
		Components: main
		Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

		Types: deb
		URIs: ${MIRROR%/debian}/debian-security
		Suites: $SUITE-security
		Components: main
		Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
	EOF
	rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/*.log \
		"$root"/var/log/apt/* "$root"/tmp/* "$root"/var/tmp/*
	# /etc/resolv.conf and /etc/hostname are the container runtime's
	rm -f "$root/etc/resolv.conf" "$root/etc/hostname"
}

# The base image in the store, bootstrapped first when its tarball is missing (or
# REFRESH_BASE=1); WORK: a directory for logs. Sets base_size.
ensure_base() {
	local WORK=$1
	mkdir -p "$TOP/base" "$STORE"
	if ((${REFRESH_BASE:-0})) || [[ ! -s $BASE_TAR ]]; then
		BOOTSTRAP_DIR="$(mktemp -d "$TOP/base/rootfs.XXXXXX")"
		log "debootstrap --variant=minbase $SUITE from $MIRROR"
		debootstrap --variant=minbase "$SUITE" "$BOOTSTRAP_DIR" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
			tail -n 20 "$WORK/debootstrap.log" >&2
			die "debootstrap failed"
		}
		slim_rootfs "$BOOTSTRAP_DIR"
		chmod 0755 "$BOOTSTRAP_DIR" # the image's / (mktemp made it 0700)
		tar --numeric-owner --xattrs -C "$BOOTSTRAP_DIR" -cf "$BASE_TAR.new" .
		mv "$BASE_TAR.new" "$BASE_TAR"
		rm -rf --one-file-system "$BOOTSTRAP_DIR"
		BOOTSTRAP_DIR=""
	fi
	base_sum="$(sha256sum "$BASE_TAR" | cut -c1-64)"
	have_sum="$(podman_ image inspect --format '{{index .Config.Labels "cozyebpf.base.sha256"}}' "$BASE_REF" 2>/dev/null || true)"
	if [[ $have_sum != "$base_sum" ]]; then
		log "importing $BASE_TAR as $BASE_REF"
		podman_ rmi --force "$BASE_REF" >/dev/null 2>&1 || true
		# the config of the official image: its PATH and CMD
		podman_ import \
			--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
			--change 'CMD ["bash"]' \
			--change "LABEL cozyebpf.base.sha256=$base_sum" \
			"$BASE_TAR" "$BASE_REF" >"$WORK/import.log" 2>&1 || {
			cat "$WORK/import.log" >&2
			die "podman import failed"
		}
	fi
	base_size="$(podman_ image inspect --format '{{.Size}}' "$BASE_REF")"
}

# Unmount and remove what a debootstrap left (never delete through a mount).
image_cleanup_bootstrap() {
	if [[ -n $BOOTSTRAP_DIR && -d $BOOTSTRAP_DIR ]]; then
		findmnt -rno TARGET | grep -F "$BOOTSTRAP_DIR" | sort -r | xargs -r -n1 umount -l
		rm -rf --one-file-system "$BOOTSTRAP_DIR"
	fi
}

# SECRETS: the --secret arguments of a build; WORK: where pip.conf is written.
pip_secrets() {
	local WORK=$1
	# pip inside the build reaches the package index as this machine's pip does:
	# its index settings (pip config, PIP_* variables) and the CA bundle it trusts
	# are passed as build secrets. Settings that name local paths (find-links,
	# constraint, file:// indexes) do not exist inside the build and are left out.
	SECRETS=()
	pip_keys="$(.venv/bin/python - "$WORK/pip.conf" <<-'EOF'
		import ast, subprocess, sys
		out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
		                     capture_output=True, text=True, check=True).stdout
		keep = {"index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout",
		        "retries", "proxy"}
		found: dict[str, tuple[int, str]] = {}
		for line in out.splitlines():
		    key, _, value = line.partition("=")
		    scope, _, name = key.rpartition(".")
		    if name not in keep:
		        continue
		    value = ast.literal_eval(value)
		    if name.endswith("index-url"):
		        value = " ".join(u for u in value.split() if not u.startswith("file:"))
		        if not value:
		            continue
		    rank = 2 if scope == ":env:" else 1  # PIP_* variables win over files
		    if name not in found or rank >= found[name][0]:
		        found[name] = (rank, value)
		with open(sys.argv[1], "w") as f:
		    f.write("[global]\n")
		    f.writelines(f"{k} = {v}\n" for k, (_, v) in sorted(found.items()))
		print(", ".join(sorted(found)) or "none")
	EOF
	)"
	SECRETS+=(--secret "id=pip_conf,src=$WORK/pip.conf")
	ca_bundle=""
	for candidate in "${PIP_CERT:-}" "$(.venv/bin/python -m pip config get global.cert 2>/dev/null || true)" \
		"${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
		if [[ -n $candidate && -s $candidate ]]; then
			ca_bundle=$candidate
			break
		fi
	done
	[[ -z $ca_bundle ]] || SECRETS+=(--secret "id=ca_bundle,src=$ca_bundle")
	log "pip settings for the build: $pip_keys (from pip config); CA bundle: ${ca_bundle:-none} (build secrets)"
}
