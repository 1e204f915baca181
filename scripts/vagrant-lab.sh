#!/usr/bin/env bash
# The Vagrant VM of vagrant/, run for real on this machine (issue 47; `make vagrant-lab`):
# libvirt's daemons started here (there is no init system to start them), the box built here
# (scripts/vagrant-box.sh), `vagrant up --provider libvirt` on the lab's own isolated network
# and storage pool, the packet tests in the VM on its own kernel (Debian 12's 6.1), the demo
# in the VM, `vagrant destroy`, then everything the lab made removed and checked gone: the
# domain, the network and its bridge and dnsmasq, the pool and its volumes (the box's base
# image too), the daemons, the firewall chains libvirt adds. Prints a row per step with its
# time. Runs as root.
#
#   scripts/vagrant-lab.sh [--pytest-args ARGS] [--no-demo] [--keep]
#     --pytest-args ARGS   more pytest arguments for the packet tests in the VM
#                          (COZYEBPF_PACKET_ARGS), e.g. "-k test_port_filter" (what CI runs)
#     --no-demo            leave the demo out
#     --keep               leave the VM and the daemons running (then: scripts/vagrant-lab.sh --down)
#   scripts/vagrant-lab.sh --down   destroy the VM and remove what the lab made
#
# The driver: software emulation (qemu's TCG) unless COZYEBPF_VAGRANT_DRIVER=kvm is set: on
# the machine this was built on /dev/kvm opens but a nested guest hangs (the kernel matrix
# found the same), so trying KVM first would cost the boot timeout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@" # as root, or again through sudo

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAME=cozyebpf-lab # the network's and the pool's name (vagrant/Vagrantfile)
POOL_DIR=/var/lib/libvirt/$NAME
CONSOLE=/var/log/libvirt/qemu/$NAME-console.log
STATE=/run/cozyebpf-vagrant-lab # what this lab started (pids), for --down
PACKET_ARGS="" DEMO=1 KEEP=0 DOWN=0
while (($#)); do
	case $1 in
	--pytest-args)
		PACKET_ARGS=$2
		shift
		;;
	--no-demo) DEMO=0 ;;
	--keep) KEEP=1 ;;
	--down) DOWN=1 ;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*)
		echo "vagrant-lab.sh: unknown argument $1 (--pytest-args ARGS, --no-demo, --keep, --down)" >&2
		exit 2
		;;
	esac
	shift
done

log() { printf '==> vagrant-lab: %s\n' "$*"; }
die() {
	printf 'vagrant-lab.sh: ERROR: %s\n' "$*" >&2
	exit 1
}
ROWS=()
row() { ROWS+=("$(printf '%-44s %-6s %s' "$1" "$2" "$3")"); }
print_rows() {
	printf '\nvagrant lab:\n'
	printf '%s\n' "${ROWS[@]}"
}

export COZYEBPF_BOX="${COZYEBPF_BOX:-cozyebpf/bookworm-local}"
export COZYEBPF_VAGRANT_DRIVER="${COZYEBPF_VAGRANT_DRIVER:-qemu}"
export COZYEBPF_VAGRANT_LAB=1
export COZYEBPF_PACKET_ARGS="$PACKET_ARGS"
export VAGRANT_CWD="$REPO_ROOT/vagrant"
# Vagrant's state of this machine outside the checkout (rsync would copy vagrant/.vagrant in)
export VAGRANT_DOTFILE_PATH="$STATE/dotfile"
VIRSH=(virsh -q -c qemu:///system)

# --- libvirt's daemons -----------------------------------------------------------------------
# virtlogd (the domain's console and qemu's log) and libvirtd (qemu, network, storage drivers
# in one; libvirt 9.0), each started here only when not running already, and stopped by the
# pid this lab recorded, never by name
daemon_running() { [[ -f /run/$1.pid ]] && kill -0 "$(cat "/run/$1.pid")" 2>/dev/null; }
start_daemons() {
	mkdir -p "$STATE"
	local autostart
	autostart="$(find /etc/libvirt/qemu/networks/autostart /etc/libvirt/storage/autostart \
		/etc/libvirt/qemu/autostart -name '*.xml' 2>/dev/null | paste -sd' ' -)"
	if [[ -n $autostart ]] && ! daemon_running libvirtd; then
		die "libvirt would start these at its start: $autostart; this lab starts only its own network (virsh net-autostart --disable, or remove the links)"
	fi
	local d
	for d in virtlogd libvirtd; do
		if daemon_running "$d"; then
			log "$d runs already (pid $(cat "/run/$d.pid")); this lab leaves it running"
			continue
		fi
		"$d" -d || die "could not start $d"
		for _ in $(seq 50); do
			daemon_running "$d" && break
			sleep 0.2
		done
		daemon_running "$d" || die "$d did not write /run/$d.pid"
		cat "/run/$d.pid" >"$STATE/$d.pid"
	done
	for _ in $(seq 50); do
		"${VIRSH[@]}" version >/dev/null 2>&1 && return 0
		sleep 0.2
	done
	die "libvirtd does not answer (virsh -c qemu:///system version)"
}
stop_daemons() {
	local d pid
	for d in libvirtd virtlogd; do
		[[ -f $STATE/$d.pid ]] || continue
		pid="$(cat "$STATE/$d.pid")"
		echo "$d $pid" >>"$STATE/stopped"
		if kill -0 "$pid" 2>/dev/null; then
			kill "$pid"
			for _ in $(seq 100); do
				kill -0 "$pid" 2>/dev/null || break
				sleep 0.1
			done
		fi
		rm -f "$STATE/$d.pid"
	done
}

# the lab's storage pool (vagrant-libvirt makes only a pool named "default" itself)
make_pool() {
	"${VIRSH[@]}" pool-define-as "$NAME" dir --target "$POOL_DIR" >/dev/null &&
		"${VIRSH[@]}" pool-build "$NAME" >/dev/null &&
		"${VIRSH[@]}" pool-start "$NAME" >/dev/null
}

# --- the firewall: libvirt's chains --------------------------------------------------------
# libvirt 9.0 puts a network's rules into chains of its own (LIBVIRT_INP, _OUT, _FWI, _FWO,
# _FWX, _PRT) that it makes at the first network's start and never removes; the lab removes
# those it made (none that were there before it)
libvirt_chains() {
	local ipt table
	for ipt in iptables ip6tables; do
		for table in filter nat mangle; do
			"$ipt" -w -t "$table" -S 2>/dev/null | awk -v i="$ipt" -v t="$table" \
				'$1 == "-N" && $2 ~ /^LIBVIRT_/ { print i, t, $2 }'
		done
	done
}
remove_libvirt_chains() {
	local before=$1 ipt table chain rule
	while read -r ipt table chain; do
		[[ -n $chain ]] || continue
		grep -qx "$ipt $table $chain" <<<"$before" && continue
		# the jumps into it, then its rules, then the chain
		while read -r rule; do
			# shellcheck disable=SC2086 # a rule of iptables -S, word for word
			"$ipt" -w -t "$table" ${rule/-A/-D}
		done < <("$ipt" -w -t "$table" -S | grep -e "-j $chain\$" || true)
		"$ipt" -w -t "$table" -F "$chain"
		"$ipt" -w -t "$table" -X "$chain"
	done < <(libvirt_chains)
}

# --- what the lab leaves: nothing ------------------------------------------------------------
teardown() {
	local t=$SECONDS
	if daemon_running libvirtd; then
		if [[ -d $VAGRANT_DOTFILE_PATH ]]; then
			vagrant destroy -f || log "vagrant destroy failed; removing the domain with virsh"
		fi
		local dom vol
		for dom in $("${VIRSH[@]}" list --all --name | grep '^vagrant_default' || true); do
			"${VIRSH[@]}" destroy "$dom" >/dev/null 2>&1 || true
			"${VIRSH[@]}" undefine "$dom" --remove-all-storage >/dev/null 2>&1 || true
		done
		if "${VIRSH[@]}" net-info "$NAME" >/dev/null 2>&1; then
			"${VIRSH[@]}" net-destroy "$NAME" >/dev/null 2>&1 || true
			"${VIRSH[@]}" net-undefine "$NAME" >/dev/null 2>&1 || true
		fi
		if "${VIRSH[@]}" pool-info "$NAME" >/dev/null 2>&1; then
			# the box's base image stays in the pool after vagrant destroy: the lab's too
			for vol in $("${VIRSH[@]}" vol-list "$NAME" | awk '{ print $1 }'); do
				"${VIRSH[@]}" vol-delete --pool "$NAME" "$vol" >/dev/null
			done
			"${VIRSH[@]}" pool-destroy "$NAME" >/dev/null 2>&1 || true
			"${VIRSH[@]}" pool-undefine "$NAME" >/dev/null 2>&1 || true
		fi
	fi
	stop_daemons
	[[ -f $STATE/chains ]] && remove_libvirt_chains "$(cat "$STATE/chains")"
	rm -rf --one-file-system "$POOL_DIR" "$VAGRANT_DOTFILE_PATH"
	rm -f "$CONSOLE" /var/log/libvirt/qemu/vagrant_default*.log
	row "vagrant destroy; the lab removed" ok "$((SECONDS - t))s"
	check_nothing_left
	rm -rf "$STATE"
}
check_nothing_left() {
	local left=()
	local d pid
	while read -r d pid; do
		kill -0 "$pid" 2>/dev/null && left+=("$d (pid $pid)")
	done < <(cat "$STATE/stopped" 2>/dev/null || true)
	pgrep -f "qemu-system-x86_64 .*vagrant_default" >/dev/null && left+=("a qemu process")
	pgrep -f "dnsmasq.*/$NAME.conf" >/dev/null && left+=("the network's dnsmasq")
	ip -br addr | grep -q '192\.168\.247\.1/' && left+=("the lab's bridge")
	[[ -e $POOL_DIR ]] && left+=("$POOL_DIR")
	[[ -f $STATE/chains && "$(libvirt_chains)" != "$(cat "$STATE/chains")" ]] &&
		left+=("firewall chains: $(libvirt_chains | paste -sd' ' -)")
	if ((${#left[@]})); then
		row "nothing left (domain, network, pool, daemons)" FAIL "${left[*]}"
		return 1
	fi
	row "nothing left (domain, network, pool, daemons)" ok "no domain, network, bridge, pool, volume, daemon or LIBVIRT_ chain"
}

if ((DOWN)); then
	teardown
	print_rows
	exit 0
fi

# --- the run ---------------------------------------------------------------------------------
START=$SECONDS
timed() { # timed NAME COMMAND...: a row with the step's time
	local name=$1 t=$SECONDS
	shift
	log "$name: $*"
	if "$@"; then
		row "$name" ok "$((SECONDS - t))s"
	else
		row "$name" FAIL "$((SECONDS - t))s (exit $?)"
		return 1
	fi
}
on_exit() {
	local rc=$?
	if ((KEEP)); then
		log "--keep: the VM and the daemons run; vagrant ssh with VAGRANT_CWD=$VAGRANT_CWD VAGRANT_DOTFILE_PATH=$VAGRANT_DOTFILE_PATH, COZYEBPF_BOX=$COZYEBPF_BOX COZYEBPF_VAGRANT_LAB=1; scripts/vagrant-lab.sh --down removes it all"
	else
		teardown || rc=1
	fi
	row "in all" "" "$((SECONDS - START))s"
	print_rows
	exit "$rc"
}

[[ -e $STATE ]] && die "$STATE exists: a lab runs or was kept (scripts/vagrant-lab.sh --down)"
timed "setup (scripts/setup.sh --vagrant)" bash "$REPO_ROOT/scripts/setup.sh" --vagrant
timed "box (scripts/vagrant-box.sh --add)" bash "$REPO_ROOT/scripts/vagrant-box.sh" --add
mkdir -p "$STATE"
libvirt_chains >"$STATE/chains"
trap on_exit EXIT
timed "libvirt's daemons (virtlogd, libvirtd)" start_daemons
timed "the lab's storage pool ($POOL_DIR)" make_pool
log "the driver: $COZYEBPF_VAGRANT_DRIVER; the box: $COZYEBPF_BOX"
timed "vagrant up --provider libvirt ($COZYEBPF_VAGRANT_DRIVER)" vagrant up --provider libvirt
timed "the VM's kernel" vagrant ssh -c 'uname -r; ip -4 route'
timed "packet tests in the VM (pytest -m packet ${PACKET_ARGS})" vagrant provision --provision-with test
if ((DEMO)); then
	timed "the demo in the VM" vagrant provision --provision-with demo
fi
