# cozyebpf DaemonSet image: Debian's bcc (python3-bpfcc) + the cozyebpf
# package in a venv that sees Debian's site packages.
#
#   docker build -t cozyebpf .
#
# The pod needs: privileged (or CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN,
# CAP_PERFMON), hostNetwork, and a hostPath /sys/fs/bpf. Mount the host's
# /lib/modules only on hosts that have kernel headers; elsewhere the
# entrypoint links the fallback headers installed below (see
# docker/entrypoint.sh).
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
