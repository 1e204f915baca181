# cozyebpf DaemonSet image: Debian's bcc (python3-bpfcc) + the cozyebpf
# package in a venv that sees Debian's site packages.
#
#   docker build -t cozyebpf .
#
# The pod needs CAP_SYS_ADMIN and CAP_NET_ADMIN (tests/test_capabilities.py
# proves that set), hostNetwork, and a hostPath /sys/fs/bpf. The host's kernel
# headers go read-only to /host/lib/modules and /host/usr/src; without them
# the entrypoint links the fallback headers installed below
# (docker/entrypoint.sh, deploy/daemonset.yaml).
FROM debian:bookworm-slim

# Debian's name for the architecture (amd64, arm64) picks the fallback
# kernel headers metapackage; BuildKit fills TARGETARCH in (amd64 otherwise).
ARG TARGETARCH

# Versions come from the bookworm snapshot the image is built from.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3-bpfcc \
        libbpfcc \
        python3-venv \
        python3-pip \
        iproute2 \
        nftables \
        ca-certificates \
        "linux-headers-${TARGETARCH:-amd64}" \
    && rm -rf /var/lib/apt/lists/*

ENV COZYEBPF_BPF_DIR=/opt/cozyebpf/bpf \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

COPY pyproject.toml /opt/cozyebpf/
COPY cozyebpf/ /opt/cozyebpf/cozyebpf/
COPY bpf/ /opt/cozyebpf/bpf/

# --system-site-packages: bcc comes from python3-bpfcc (never `pip install
# bcc`, an unrelated PyPI package). A regular (not editable) install: the C
# sources are found through COZYEBPF_BPF_DIR.
# hadolint ignore=DL3013
RUN python3 -m venv --system-site-packages /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check /opt/cozyebpf \
    && /opt/venv/bin/python -c 'import bcc, cozyebpf'

COPY docker/entrypoint.sh /usr/local/bin/cozyebpf-entrypoint
RUN chmod 0755 /usr/local/bin/cozyebpf-entrypoint

ENTRYPOINT ["/usr/local/bin/cozyebpf-entrypoint"]
CMD ["run", "--help"]
