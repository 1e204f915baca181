# cozyebpf DaemonSet image: Debian's bcc (python3-bpfcc) + the cozyebpf
# package in a venv that sees Debian's site packages, and Debian's kernel
# headers as the fallback bcc compiles against.
#
#   podman build -t cozyebpf .      (or: docker build -t cozyebpf .)
#
# The pod needs CAP_SYS_ADMIN and CAP_NET_ADMIN (tests/datapath/test_capabilities.py
# proves that set), hostNetwork, and a hostPath /sys/fs/bpf. The host's kernel
# headers go read-only to /host/lib/modules and /host/usr/src; without them
# the entrypoint links the fallback headers below (docker/entrypoint.sh,
# deploy/daemonset.yaml). `make image-test` builds this file and runs the
# end-to-end tests with the agent from the image (deploy/README.md).
#
# Two stages build what the image needs without leaving their tools in it:
# pip, venv's wheels, gcc (which linux-headers-<arch> depends on) and
# ca-certificates stay behind. The last stage installs only what the agent
# runs: python3-bpfcc with libbpfcc and the LLVM it links (bcc compiles the
# datapath at start), nftables (the agent runs `nft` to find cozy-proxy's
# table), iproute2 (not run by the agent: for `ip link`/`tc` when debugging a
# node with kubectl exec).
#
# Package indexes behind a private CA or mirror: pass pip's settings as build
# secrets, which are mounted only while pip runs and never stored in a layer:
#   --secret id=pip_conf,src=FILE     a pip.conf (index-url, trusted-host, ...)
#   --secret id=ca_bundle,src=FILE    a PEM bundle for pip's TLS (PIP_CERT)
# scripts/image-test.sh passes the machine's own settings this way.

# --- the agent's Python packages, from pyproject.toml's dependencies --------
FROM debian:bookworm-slim AS venv

# Versions come from the bookworm snapshot the image is built from.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3-venv \
        ca-certificates \
    && apt-get clean && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md /src/
COPY cozyebpf/ /src/cozyebpf/

# A venv of its own (no system site packages here, so that no package of this
# stage stands in for a dependency), a regular (not editable) install of
# cozyebpf and its dependencies, then pip and setuptools out of the venv. The
# last stage turns the system site packages on: bcc comes from python3-bpfcc
# (never `pip install bcc`, an unrelated PyPI package).
# hadolint ignore=DL3013,SC1091
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    set -eu; \
    if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    python3 -m venv /opt/venv; \
    PIP_NO_INPUT=1 /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        --progress-bar off /src; \
    /opt/venv/bin/pip uninstall --yes --disable-pip-version-check pip setuptools; \
    rm -f /opt/venv/bin/activate* /opt/venv/bin/pip*

# --- the fallback kernel headers, unpacked without their dependencies -------
FROM debian:bookworm-slim AS headers

# Debian's name for the architecture (amd64, arm64) picks the headers
# metapackage; BuildKit and buildah fill TARGETARCH in (else: the stage's own).
ARG TARGETARCH

# linux-headers-<arch> depends on gcc and kbuild, which bcc does not use (it
# compiles with libclang against the header files): the two packages of header
# files are unpacked, not installed (dpkg does not list them; the file
# /usr/src/cozyebpf-fallback-headers.txt names the packages and versions), and
# the -common package's arch/ directories of other architectures (14 MB on
# amd64) are left out.
# hadolint ignore=DL3008
RUN set -eu; \
    arch="${TARGETARCH:-$(dpkg --print-architecture)}"; \
    apt-get update; \
    hdr="$(apt-cache depends "linux-headers-$arch" | sed -n 's/^ *Depends: \(linux-headers-.*\)$/\1/p' | head -n1)"; \
    common="$(apt-cache depends "$hdr" | sed -n 's/^ *Depends: \(linux-headers-.*-common\)$/\1/p' | head -n1)"; \
    mkdir -p /tmp/debs /out; \
    cd /tmp/debs; \
    apt-get download "$hdr" "$common"; \
    for deb in ./*.deb; do dpkg-deb -x "$deb" /out; done; \
    case "$arch" in amd64 | i386) karch=x86 ;; arm64) karch=arm64 ;; *) karch="" ;; esac; \
    if [ -n "$karch" ] && [ -d /out/usr/src/"$common"/arch/"$karch" ]; then \
        find /out/usr/src/"$common"/arch -mindepth 1 -maxdepth 1 ! -name "$karch" -exec rm -rf {} +; \
    fi; \
    for deb in ./*.deb; do dpkg-deb --show --showformat '${Package} ${Version}\n' "$deb"; done \
        > /out/usr/src/cozyebpf-fallback-headers.txt; \
    rm -rf /out/usr/share /out/lib /tmp/debs /var/lib/apt/lists/*

# --- the image ----------------------------------------------------------------
FROM debian:bookworm-slim

# The release (`make release` passes pyproject.toml's version; `cozyebpf --version` says the
# same, with the map layout).
ARG VERSION=dev
LABEL org.opencontainers.image.title="cozyebpf" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/cozystack/cozyebpf"

# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3-bpfcc \
        libbpfcc \
        nftables \
        iproute2 \
    && apt-get clean && rm -rf /var/lib/apt/lists/*

ENV COZYEBPF_BPF_DIR=/opt/cozyebpf/bpf \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

COPY --from=headers /out/usr/src/ /usr/src/
COPY --from=venv /opt/venv/ /opt/venv/
COPY bpf/ /opt/cozyebpf/bpf/
COPY docker/entrypoint.sh /usr/local/bin/cozyebpf-entrypoint

# The venv sees Debian's bcc from here on; the import proves that it does.
# /lib/modules: the mount point of the entrypoint's header links (an emptyDir).
RUN sed -i 's/^include-system-site-packages = false$/include-system-site-packages = true/' \
        /opt/venv/pyvenv.cfg \
    && mkdir -p /lib/modules \
    && chmod 0755 /usr/local/bin/cozyebpf-entrypoint \
    && /opt/venv/bin/python -c 'import bcc, cozyebpf.cli' \
    && /opt/venv/bin/cozyebpf --version

ENTRYPOINT ["/usr/local/bin/cozyebpf-entrypoint"]
CMD ["run", "--help"]
