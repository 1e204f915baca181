#!/usr/bin/env bash
# End to end on the VM's k3s + Cilium (vagrant/k8s.sh): cozyebpf runs on the VM
# itself against the cluster (no image) and gives a LoadBalancer IP as a whole
# to a pod. Run as root (the `e2e` provisioner does):
#
#   vagrant provision --provision-with e2e
#
#   client netns cze2e-client             the VM (k3s node)
#   eth0 192.0.2.2/24  ================== cze2e0 192.0.2.1/24  (cozyebpf + Cilium)
#   203.0.113.0/24 via 192.0.2.1                         |
#                                          pod: httpd on 8080 and 22
#
# The Service is labelled for cozy-proxy, has wholeIP "true" and lists only
# port 22. From the client namespace, port 8080 of its LB IP must answer:
# Cilium 1.19 drops unlisted ports of an LB IP (wildcard entry), so only
# cozyebpf's whole-IP NAT gets 8080 through. Port 22 and ping are checked too.
# Before cozyebpf starts, the same requests are made once for comparison.
# Everything is removed at the end, also on failure.
#
# Environment: KEEP=1 leaves the agent, namespace and pod in place for a look.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KUBECONFIG=/etc/rancher/k3s/k3s.yaml
export KUBECONFIG
NETNS=cze2e-client
DEV=cze2e0
HOST_IP=192.0.2.1
CLIENT_IP=192.0.2.2
LB_CIDR=203.0.113.0/24
FALLBACK_LB_IP=203.0.113.10
NS=cozyebpf-e2e
MARKER=cozyebpf-e2e-ok
PIN_DIR=/sys/fs/bpf/cozyebpf-e2e
HEALTH=127.0.0.1:19810
WORK="$(mktemp -d /tmp/cozyebpf-e2e.XXXXXX)"
AGENT_LOG="$WORK/agent.log"
AGENT_PID=""
COZYEBPF=("$REPO_ROOT/.venv/bin/python" -m cozyebpf)

log() { printf '==> %s\n' "$*"; }
die() {
	printf 'e2e.sh: FAILED: %s\n' "$*" >&2
	exit 1
}

cleanup() {
	local rc=$?
	if [[ ${KEEP:-} == 1 ]]; then
		log "KEEP=1: leaving agent (pid ${AGENT_PID:-none}, log $AGENT_LOG), namespace $NS and netns $NETNS"
		return
	fi
	log "cleaning up"
	if [[ -n $AGENT_PID ]] && kill -0 "$AGENT_PID" 2>/dev/null; then
		kill -TERM "$AGENT_PID"
		wait "$AGENT_PID" || true
	fi
	if ((rc != 0)) && [[ -s $AGENT_LOG ]]; then
		printf -- '--- agent log (last 40 lines) ---\n' >&2
		tail -n 40 "$AGENT_LOG" >&2
	fi
	(cd "$REPO_ROOT" && "${COZYEBPF[@]}" detach --pin-dir "$PIN_DIR" >/dev/null) || true
	kubectl delete namespace "$NS" --wait=false >/dev/null 2>&1 || true
	ip netns del "$NETNS" 2>/dev/null || true
	rm -rf "$WORK"
}
trap cleanup EXIT

in_client() { ip netns exec "$NETNS" "$@"; }

# fetch PORT: the page the pod serves on LB_IP:PORT, seen from the client
fetch() { in_client curl -sS -m 5 "http://$LB_IP:$1/" 2>/dev/null || true; }

[[ $(id -u) -eq 0 ]] || die "must run as root"
[[ -f $KUBECONFIG ]] || die "no $KUBECONFIG: run 'vagrant provision --provision-with k8s' first"
kubectl get --raw=/readyz >/dev/null || die "the cluster's API server does not answer"

log "setting up cozyebpf (scripts/setup.sh)"
bash "$REPO_ROOT/scripts/setup.sh" >"$WORK/setup.log" 2>&1 || {
	cat "$WORK/setup.log" >&2
	die "scripts/setup.sh failed"
}

# --- the client namespace -------------------------------------------------------------
log "client namespace $NETNS: $CLIENT_IP, $LB_CIDR via $HOST_IP ($DEV on the VM)"
ip netns del "$NETNS" 2>/dev/null || true
ip link del "$DEV" 2>/dev/null || true
ip netns add "$NETNS"
ip link add "$DEV" type veth peer name eth0 netns "$NETNS"
ip addr add "$HOST_IP/24" dev "$DEV"
ip link set "$DEV" up
in_client ip link set lo up
in_client ip addr add "$CLIENT_IP/24" dev eth0
in_client ip link set eth0 up
in_client ip route add "$LB_CIDR" via "$HOST_IP"

# --- Cilium on the new device -----------------------------------------------------------
# The LB IP's packets must meet Cilium's datapath on $DEV, as they would on a
# real uplink (k8s.sh lists cze2e+ in Cilium's devices). Cilium may pick a new
# device up by itself; if it has not, a restart makes it.
cilium_has_dev() {
	kubectl -n kube-system exec daemonset/cilium -c cilium-agent -- cilium-dbg status 2>/dev/null |
		grep -q -w "$DEV"
}
if ! cilium_has_dev; then
	log "restarting Cilium so that it attaches to $DEV"
	kubectl -n kube-system rollout restart daemonset/cilium >/dev/null
	kubectl -n kube-system rollout status daemonset/cilium --timeout=5m >/dev/null
	for _ in $(seq 1 30); do
		cilium_has_dev && break
		sleep 2
	done
fi
cilium_has_dev || die "Cilium does not manage $DEV (its devices must include it: see vagrant/k8s.sh)"
log "Cilium manages $DEV"

# --- the pod and its whole-IP Service -----------------------------------------------------
log "deploying the pod (httpd on 8080 and 22) and its LoadBalancer Service (wholeIP, port 22 only)"
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Namespace
metadata:
  name: $NS
---
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: $NS
  labels:
    app: cozyebpf-e2e
spec:
  containers:
    - name: web
      image: busybox:1.36
      command:
        - sh
        - -c
        - mkdir -p /www && echo $MARKER > /www/index.html && httpd -p 22 -h /www && exec httpd -f -p 8080 -h /www
      ports:
        - containerPort: 8080
        - containerPort: 22
      readinessProbe:
        tcpSocket:
          port: 8080
        periodSeconds: 2
---
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: $NS
  labels:
    service.kubernetes.io/service-proxy-name: cozy-proxy
  annotations:
    networking.cozystack.io/wholeIP: "true"
spec:
  type: LoadBalancer
  selector:
    app: cozyebpf-e2e
  ports:
    - name: ssh
      protocol: TCP
      port: 22
      targetPort: 22
EOF
kubectl -n "$NS" wait --for=condition=Ready pod/web --timeout=5m >/dev/null ||
	die "the pod did not become ready (image pull? kubectl -n $NS describe pod web)"

lb_ip() { kubectl -n "$NS" get service web -o jsonpath='{.status.loadBalancer.ingress[0].ip}'; }
LB_IP=""
for _ in $(seq 1 30); do
	LB_IP="$(lb_ip)"
	[[ -n $LB_IP ]] && break
	sleep 2
done
if [[ -z $LB_IP ]]; then
	# Cilium (agent and LB-IPAM) leaves alone the Services whose
	# service.kubernetes.io/service-proxy-name label does not match its
	# k8sServiceProxyName (empty by default). In a real cluster another allocator
	# (MetalLB, for example) assigns the IP; here the status is written as it would.
	LB_IP=$FALLBACK_LB_IP
	log "NOTE: LB-IPAM assigned no IP to the cozy-proxy Service; writing status.loadBalancer $LB_IP as an allocator would"
	kubectl -n "$NS" patch service web --subresource=status --type=merge \
		-p "{\"status\":{\"loadBalancer\":{\"ingress\":[{\"ip\":\"$LB_IP\"}]}}}" >/dev/null
fi
POD_IP="$(kubectl -n "$NS" get pod web -o jsonpath='{.status.podIP}')"
log "Service web: LB IP $LB_IP -> pod $POD_IP"

# --- without cozyebpf ---------------------------------------------------------------------
describe() { [[ $1 == "$MARKER" ]] && echo "answers" || echo "no answer"; }
log "without cozyebpf: port 22 $(describe "$(fetch 22)"), port 8080 $(describe "$(fetch 8080)")" \
	"(Cilium 1.19, if it handles this Service: 22 answers, 8080 is dropped by the wildcard entry)"
[[ $(fetch 8080) != "$MARKER" ]] ||
	log "WARNING: port 8080 answers without cozyebpf: nothing here drops unlisted ports"

# --- with cozyebpf ------------------------------------------------------------------------
log "starting cozyebpf run --kubeconfig $KUBECONFIG --devices $DEV (log: $AGENT_LOG)"
(
	cd "$REPO_ROOT"
	# its own session: with KEEP=1 it outlives the provisioner's ssh session
	exec setsid "${COZYEBPF[@]}" run --kubeconfig "$KUBECONFIG" --devices "$DEV" \
		--pin-dir "$PIN_DIR" --node-name "$(hostname)" --health-address "$HEALTH"
) >"$AGENT_LOG" 2>&1 &
AGENT_PID=$!
ready=""
for _ in $(seq 1 90); do
	kill -0 "$AGENT_PID" 2>/dev/null || die "the agent exited (log above)"
	if [[ $(curl -s -o /dev/null -w '%{http_code}' "http://$HEALTH/readyz" || true) == 200 ]]; then
		ready=1
		break
	fi
	sleep 2
done
[[ -n $ready ]] || die "the agent did not become ready in 3 minutes"
log "agent ready: $(grep -m 1 'datapath ready' "$AGENT_LOG" | sed 's/.*: datapath ready/datapath ready/')"

failed=()
got="$(fetch 8080)"
[[ $got == "$MARKER" ]] || failed+=("port 8080 (not in spec.ports): got '${got}'")
got="$(fetch 22)"
[[ $got == "$MARKER" ]] || failed+=("port 22: got '${got}'")
in_client ping -c 2 -W 2 "$LB_IP" >/dev/null || failed+=("ping $LB_IP")

log "cozyebpf maps dump:"
(cd "$REPO_ROOT" && "${COZYEBPF[@]}" maps dump --pin-dir "$PIN_DIR") | sed 's/^/    /'

if ((${#failed[@]} > 0)); then
	die "through LB IP $LB_IP: ${failed[*]}"
fi
log "PASSED: from $NETNS, $LB_IP answers on 8080 (not in spec.ports), on 22, and to ping"
