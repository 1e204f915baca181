#!/usr/bin/env bash
# A one-node Kubernetes in the VM for vagrant/e2e.sh: k3s without flannel,
# kube-proxy, servicelb and traefik; Cilium as CNI and kube-proxy replacement,
# with LB-IPAM handing out 203.0.113.0/24. Idempotent: what is installed
# already is kept. Run as root (the `k8s` provisioner does):
#
#   vagrant provision --provision-with k8s
#
# Environment:
#   CILIUM_VERSION   Cilium to install (default 1.19.0; use the newest 1.19.x)
#   LB_POOL_CIDR     LB-IPAM pool (default 203.0.113.0/24)
#   E2E_DEVICES      Cilium device pattern for the veth that e2e.sh creates
#                    towards its client namespace (default cze2e+): Cilium
#                    attaches to it as to any uplink, so the e2e traffic meets
#                    Cilium's datapath.
set -euo pipefail

CILIUM_VERSION="${CILIUM_VERSION:-1.19.0}"
LB_POOL_CIDR="${LB_POOL_CIDR:-203.0.113.0/24}"
E2E_DEVICES="${E2E_DEVICES:-cze2e+}"
KUBECONFIG=/etc/rancher/k3s/k3s.yaml
export KUBECONFIG

log() { printf '==> %s\n' "$*"; }
die() {
	printf 'k8s.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

[[ $(id -u) -eq 0 ]] || die "must run as root"

# cozyebpf's egress hook needs tcx (Linux >= 6.6): refuse to build a cluster
# on the box's original kernel, as the test provisioner does.
krel="$(uname -r)"
major="${krel%%.*}"
rest="${krel#*.}"
minor="${rest%%.*}"
if ((major < 6 || (major == 6 && minor < 6))); then
	die "the VM runs kernel $krel (< 6.6, no tcx): run 'vagrant reload' once first"
fi

export DEBIAN_FRONTEND=noninteractive
if ! command -v curl >/dev/null; then
	apt-get update -q
	apt-get install -y -q curl ca-certificates
fi

# The uplink (default route) and its address: Cilium reaches the API server
# there, because there is no kube-proxy to serve the `kubernetes` ClusterIP
# before Cilium runs.
uplink="$(ip -4 route show default | awk '{print $5; exit}')"
node_ip="$(ip -4 -o addr show dev "$uplink" | awk '{split($4, a, "/"); print a[1]; exit}')"
[[ -n $uplink && -n $node_ip ]] || die "no default IPv4 route: cannot tell the node's address"
log "uplink $uplink, node address $node_ip"

# --- k3s ------------------------------------------------------------------------
if systemctl is-active --quiet k3s; then
	log "k3s: running ($(k3s --version | head -n 1))"
else
	log "installing k3s (no flannel, no kube-proxy, no servicelb, no traefik)"
	curl -sfL https://get.k3s.io |
		INSTALL_K3S_EXEC='--flannel-backend=none --disable-network-policy --disable=servicelb --disable=traefik --disable-kube-proxy' sh -
fi
for _ in $(seq 1 60); do
	kubectl get --raw=/readyz >/dev/null 2>&1 && break
	sleep 2
done
kubectl get --raw=/readyz >/dev/null || die "the k3s API server does not answer"

# --- cilium CLI -------------------------------------------------------------------
if command -v cilium >/dev/null; then
	log "cilium CLI: $(cilium version --client 2>/dev/null | head -n 1)"
else
	cli_version="$(curl -sfL https://raw.githubusercontent.com/cilium/cilium-cli/main/stable.txt)"
	cli_arch=amd64
	[[ $(uname -m) == aarch64 ]] && cli_arch=arm64
	log "installing the cilium CLI $cli_version ($cli_arch)"
	tmp="$(mktemp -d)"
	(
		cd "$tmp"
		curl -sfL --remote-name-all \
			"https://github.com/cilium/cilium-cli/releases/download/${cli_version}/cilium-linux-${cli_arch}.tar.gz"{,.sha256sum}
		sha256sum --check "cilium-linux-${cli_arch}.tar.gz.sha256sum"
		tar -xzf "cilium-linux-${cli_arch}.tar.gz" -C /usr/local/bin cilium
	)
	rm -rf "$tmp"
fi

# --- Cilium -------------------------------------------------------------------------
# k3s's containerd looks for CNI plugins and configs in its own directories,
# not /opt/cni/bin and /etc/cni/net.d: Cilium must install there. They are
# read from the containerd config that k3s generated.
containerd_cfg=/var/lib/rancher/k3s/agent/etc/containerd/config.toml
cni_dir() { # bin|conf DEFAULT
	local found=""
	if [[ -f $containerd_cfg ]]; then
		found="$(sed -n -E "s/^[[:space:]]*$1_dirs?[[:space:]]*=[[:space:]]*\[?[[:space:]]*[\"']([^\"']+)[\"'].*/\1/p" "$containerd_cfg" | head -n 1)"
	fi
	printf '%s\n' "${found:-$2}"
}
default_bin=/var/lib/rancher/k3s/data/current/bin
[[ -d /var/lib/rancher/k3s/data/cni ]] && default_bin=/var/lib/rancher/k3s/data/cni
cni_bin="$(cni_dir bin "$default_bin")"
cni_conf="$(cni_dir conf /var/lib/rancher/k3s/agent/etc/cni/net.d)"
log "k3s CNI directories: $cni_bin, $cni_conf"

if kubectl -n kube-system get daemonset cilium >/dev/null 2>&1; then
	log "Cilium: installed already (kept as it is)"
else
	log "installing Cilium $CILIUM_VERSION (kube-proxy replacement, LB-IPAM)"
	# ipam.mode=kubernetes: the pod CIDR k3s gives the node (10.42.0.0/24).
	# devices: the uplink and e2e.sh's veth, which does not exist yet (and a
	# veth without a default route is never auto-detected).
	# bpf.masquerade: masquerading in Cilium's tc egress program, after
	# cozyebpf's (which is first in tcx), not in iptables before both.
	cilium install --version "$CILIUM_VERSION" \
		--set kubeProxyReplacement=true \
		--set k8sServiceHost="$node_ip" \
		--set k8sServicePort=6443 \
		--set ipam.mode=kubernetes \
		--set cni.binPath="$cni_bin" \
		--set cni.confPath="$cni_conf" \
		--set bpf.masquerade=true \
		--set "devices={${uplink},${E2E_DEVICES}}"
fi
log "waiting for Cilium"
cilium status --wait --wait-duration 10m >/dev/null || {
	cilium status || true
	die "Cilium did not become ready"
}
kubectl wait --for=condition=Ready node --all --timeout=5m >/dev/null

# --- LB-IPAM pool -------------------------------------------------------------------
pool() {
	cat <<-EOF
		apiVersion: cilium.io/$1
		kind: CiliumLoadBalancerIPPool
		metadata:
		  name: cozyebpf-e2e
		spec:
		  blocks:
		    - cidr: "$LB_POOL_CIDR"
	EOF
}
# cilium.io/v2 where the CRD serves it (1.18 and later), else v2alpha1.
if ! pool v2 | kubectl apply -f - 2>/dev/null; then
	pool v2alpha1 | kubectl apply -f -
fi

log "ready: k3s $(kubectl get nodes -o jsonpath='{.items[0].status.nodeInfo.kubeletVersion}'), Cilium $CILIUM_VERSION, LB-IPAM pool $LB_POOL_CIDR"
log "next: vagrant provision --provision-with e2e"
