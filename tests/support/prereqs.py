"""What the tests need from the machine, checked once, at collection (tests/conftest.py).

Each prerequisite has a name and a check that says, when it is missing, what is missing and how
to get it. A test says what it needs with markers:

- `datapath`: every test under tests/datapath (the directory adds the marker) and the few
  elsewhere that need the kernel: the prerequisites in DATAPATH (root, bcc, kernel headers,
  bpffs and the commands the namespace lab runs).
- `requires("capsh")`, ...: further prerequisites by name (PREREQUISITES).
- a fixture in FIXTURES, directly or through other fixtures: the fixture `helm` needs helm.

Outside CI a test whose prerequisites are missing is skipped with the reason before any of its
fixtures runs (module-scoped ones too: they would load BPF); under CI=true it fails.

COZYEBPF_TEST_MISSING=bcc,root (comma-separated names) reports those prerequisites as missing
whatever the machine has: how tests/unit/test_prerequisites.py checks this check.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORCE_ENV = "COZYEBPF_TEST_MISSING"


def _root() -> str | None:
    if os.geteuid() == 0:
        return None
    return "root (run as root: the tests load BPF programs and make namespaces)"


def _bcc() -> str | None:
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        return f"bcc ({e}; apt-get install python3-bpfcc and use the .venv of scripts/setup.sh)"
    return None


def _admin_capabilities() -> str | None:
    """CAP_SYS_ADMIN (21) and CAP_NET_ADMIN (12) in this process's effective set: a root in a
    container may lack them."""
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    want = (1 << 21) | (1 << 12)
    if eff & want == want:
        return None
    return "CAP_SYS_ADMIN and CAP_NET_ADMIN (a privileged container, or root on the host)"


def _kernel_headers() -> str | None:
    build = Path(f"/lib/modules/{os.uname().release}/build")
    return None if build.exists() else f"kernel headers at {build} (run scripts/setup.sh)"


def _bpffs() -> str | None:
    if os.path.ismount("/sys/fs/bpf"):
        return None
    return "bpffs at /sys/fs/bpf (mount -t bpf bpf /sys/fs/bpf)"


def find_helm() -> str | None:
    """helm beside this Python, in the repository's .venv (scripts/setup.sh puts it there), or
    on PATH."""
    for candidate in (Path(sys.executable).parent / "helm", REPO / ".venv" / "bin" / "helm"):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("helm")


def _helm() -> str | None:
    return None if find_helm() else "helm (scripts/setup.sh installs it into .venv/bin)"


def _command(name: str, package: str) -> Callable[[], str | None]:
    def check() -> str | None:
        return None if shutil.which(name) else f"the {name} command (apt-get install {package})"

    return check


def _vagrant() -> str | None:
    """Vagrant with its libvirt provider, libvirt's daemons and qemu, from Debian (the Vagrant
    VM's lab, scripts/vagrant-lab.sh), and the kernel matrix's root the box is built from."""
    names = ("vagrant", "libvirtd", "virtlogd", "virsh", "qemu-system-x86_64", "qemu-img", "rsync")
    lacking = [n for n in names if shutil.which(n) is None]
    gems = Path("/usr/share/rubygems-integration/all/gems")
    if not any(gems.glob("vagrant-libvirt-*")):
        lacking.append("the vagrant-libvirt plugin")
    if not lacking:
        return None
    return f"{', '.join(lacking)} (scripts/setup.sh --vagrant installs them)"


def _ovn() -> str | None:
    """Open vSwitch and OVN (userspace datapath: taps) and Kube-OVN's iptables/ipset, for the
    lab on the real dataplane (cozylab/realovn/)."""
    names = ("ovsdb-server", "ovs-vswitchd", "ovn-northd", "ovn-controller", "ipset")
    lacking = [n for n in (*names, "iptables-restore") if shutil.which(n) is None]
    if not Path("/dev/net/tun").exists():
        lacking.append("/dev/net/tun")
    if not lacking:
        return None
    return (
        f"{', '.join(lacking)} (scripts/setup.sh installs openvswitch-switch, ovn-central, "
        "ovn-host, ipset, iptables)"
    )


def _kernel_guest() -> str | None:
    """qemu and the kernel matrix's guests (cozylab/kmatrix.py), which scripts/setup.sh
    --kernel-guests (scripts/test.sh runs it so) builds once."""
    from cozylab.kmatrix import missing

    why = missing()
    return None if why is None else f"the kernel-matrix guests: {why}"


def _fq() -> str | None:
    """The fq qdisc (CONFIG_NET_SCH_FQ), which shaped egress needs: added to the loopback of a
    network namespace of its own."""
    try:
        p = subprocess.run(
            ["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "fq"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the fq qdisc (could not try it: {e})"
    if p.returncode == 0:
        return None
    return f"the fq qdisc (this kernel has none: {p.stderr.strip()}; CONFIG_NET_SCH_FQ)"


def _kube() -> str | None:
    """etcd, kube-apiserver and kube-controller-manager of the pinned release, built by
    scripts/build-kube.sh (setup.sh --kube runs it), for the labs' real control plane."""
    from cozylab.kubecp import missing_prerequisites

    lacking = missing_prerequisites()
    return "; ".join(lacking) if lacking else None


def _real_node() -> str | None:
    """What the real-node lab runs (cozylab/realnode/): Kubernetes' node binaries, containerd,
    runc and the CNI plugins (scripts/setup.sh --real-node builds and installs them), and
    podman and debootstrap for the agent's images."""
    from cozylab.realnode.spec import missing_prerequisites

    lacking = missing_prerequisites()
    lacking += [
        f"the {c} command (scripts/setup.sh --real-node installs it)"
        for c in ("podman", "debootstrap")
        if shutil.which(c) is None
    ]
    return "; ".join(lacking) if lacking else None


#: name -> check: None when present, else what is missing and how to get it
PREREQUISITES: dict[str, Callable[[], str | None]] = {
    "root": _root,
    "admin-capabilities": _admin_capabilities,
    "bcc": _bcc,
    "kernel-headers": _kernel_headers,
    "bpffs": _bpffs,
    "ip": _command("ip", "iproute2"),
    "tc": _command("tc", "iproute2"),
    "nsenter": _command("nsenter", "util-linux"),
    "nft": _command("nft", "nftables"),
    "curl": _command("curl", "curl"),
    "ping": _command("ping", "iputils-ping"),
    "ethtool": _command("ethtool", "ethtool"),
    "capsh": _command("capsh", "libcap2-bin"),
    "shellcheck": _command("shellcheck", "shellcheck"),
    "helm": _helm,
    "ovn": _ovn,
    "kernel-guest": _kernel_guest,
    "kube": _kube,
    "real-node": _real_node,
    "vagrant": _vagrant,
    "fq": _fq,
}

#: prerequisites that are how the kernel was built, which no set-up changes: a test that needs
#: one and that the kernel matrix runs in its CI guest (cozylab/kmatrix.py, TESTS["ci"]) is
#: skipped, CI or not, where this kernel lacks it -- test_kernel_guest runs it in the guest on
#: every run and fails unless it passes there (this machine's kernel has no fq)
IN_GUEST = frozenset({"fq"})


def runs_in_guest(path: Path, lacking: Iterable[str]) -> bool:
    """Whether a test file whose prerequisites `lacking` are missing here runs in the kernel
    matrix's CI guest instead (IN_GUEST)."""
    from cozylab.kmatrix import TESTS

    names = set(lacking)
    rel = path.resolve().relative_to(REPO).as_posix()
    return bool(names) and names <= IN_GUEST and rel in TESTS["ci"]


#: what the marker `datapath` needs: loading BPF and the namespace lab
DATAPATH = (
    *("root", "admin-capabilities", "bcc", "kernel-headers", "bpffs"),
    *("ip", "tc", "nsenter", "nft", "curl", "ping", "ethtool"),
)

#: fixture -> what a test that uses it (directly or through another fixture) needs
FIXTURES = {"helm": ("helm",)}


def forced() -> frozenset[str]:
    """The names COZYEBPF_TEST_MISSING reports as missing."""
    names = frozenset(n.strip() for n in os.environ.get(FORCE_ENV, "").split(",") if n.strip())
    unknown = names - set(PREREQUISITES)
    if unknown:
        raise ValueError(
            f"{FORCE_ENV}: unknown prerequisites {', '.join(sorted(unknown))} "
            f"(known: {', '.join(PREREQUISITES)})"
        )
    return names


@functools.cache
def missing(name: str) -> str | None:
    """Why prerequisite `name` is missing, or None (checked once per run)."""
    if name not in PREREQUISITES:
        raise ValueError(f"unknown prerequisite {name!r} (known: {', '.join(PREREQUISITES)})")
    if name in forced():
        return f"{name} ({FORCE_ENV} says it is missing)"
    return PREREQUISITES[name]()


def missing_of(names: Iterable[str]) -> list[str]:
    """What is missing of `names`, in order, each once."""
    return [m for n in dict.fromkeys(names) if (m := missing(n)) is not None]
