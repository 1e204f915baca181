# Benchmarks (not part of the test suite): run as root from the repository root.
# `make bench` runs everything (about 10-15 minutes on 2 vCPU), `make bench-quick` fewer
# repetitions and sizes (under 3 minutes). See bench/README.md.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-quick bench-setup image-test cluster-lab real-ovn-lab real-node-lab deploy release kernel-matrix vagrant-box vagrant-lab

# deploy/ rendered from the chart (charts/cozyebpf), the one source of truth; run it after
# every change to the chart (tests/unit/test_chart.py fails while deploy/ differs).
deploy:
	bash scripts/setup.sh
	bash scripts/render-deploy.sh

# A release, for the version in pyproject.toml (scripts/release.py says each step): checks that
# every place naming it is in step and that CHANGELOG.md has its section, then writes
# dist/release-X.Y.Z/: the packaged chart (helm package), RELEASE-NOTES.md (that section), the
# image as an archive (podman build of the Dockerfile, tagged vX.Y.Z) and SHA256SUMS, and prints
# the steps that publish them. RELEASE_ARGS='--no-image' skips the image (no builder here).
release:
	bash scripts/setup.sh
	$(PYTHON) scripts/release.py $(RELEASE_ARGS)

# The DaemonSet image, built from the Dockerfile with podman and proven by the end-to-end
# lab tests with every cozyebpf command run from it (about 4 minutes with the base cached;
# not part of CI). Options: make image-test IMAGE_TEST_ARGS='--keep-image' (see
# scripts/image-test.sh --help). deploy/README.md says what it shows and what it cannot.
image-test:
	bash scripts/image-test.sh $(IMAGE_TEST_ARGS)

# The cluster lab of issue 18 (cozylab/cluster/): three nodes, Kube-OVN-like and per-pod
# layouts, one agent per node; prints scenario x case x layout with PASS/FAIL and the
# migration figures (about a minute per layout). Options, e.g.:
# make cluster-lab CLUSTER_LAB_ARGS='--layout kubeovn --observer count'
cluster-lab:
	bash scripts/setup.sh --kube
	PYTHONPATH=. $(PYTHON) -m cozylab.cluster $(CLUSTER_LAB_ARGS)

# The same lab on Kube-OVN's real dataplane (cozylab/realovn/, issue 27): Open vSwitch and
# OVN themselves (userspace datapath), three chassis, Kube-OVN's topology and node side; every
# row of the kubeovn layout plus OVN's port security and the real dataplane's own rows (about
# 75 s; tests/datapath/test_real_ovn.py runs the same rows in the suite). Options, e.g.:
# make real-ovn-lab REAL_OVN_LAB_ARGS='--observer count --json rows.json'
real-ovn-lab:
	bash scripts/setup.sh --kube
	PYTHONPATH=. $(PYTHON) -m cozylab.realovn $(REAL_OVN_LAB_ARGS)

# The real-node lab of issue 44 (cozylab/realnode/): two nodes that each run their own
# containerd, kubelet and kube-proxy; the chart installed with helm, backends as real Pods, the
# lifecycle with helm and kubectl under traffic, upgrade and rollback from the previous
# release's own chart and image; prints a row per check (about 10 minutes with the images
# built; tests/datapath/test_real_node.py runs the same). Options, e.g.:
# make real-node-lab REAL_NODE_LAB_ARGS='--workdir /tmp/rn'
real-node-lab:
	bash scripts/setup.sh --real-node
	PYTHONPATH=. $(PYTHON) -m cozylab.realnode $(REAL_NODE_LAB_ARGS)

# The kernel matrix of issue 36 (scripts/kernel-matrix.sh, cozylab/kmatrix.py): the datapath's
# tests on Debian's Linux 6.1 and 6.12 under qemu and on this machine's kernel, one table of
# tests and verified instructions per kernel (about 40 minutes; the guests' root file system is
# built once into /var/cache/cozyebpf/kernel-matrix). Options, e.g.:
# make kernel-matrix KERNEL_MATRIX_ARGS='--kernels 6.1,host --plan ci'
kernel-matrix:
	bash scripts/kernel-matrix.sh $(KERNEL_MATRIX_ARGS)

# The Vagrant VM's box (vagrant/, issue 47), built here from Debian's packages (the kernel
# matrix's root file system, Debian's 6.1 kernel, sshd, GRUB, the tests' Python dependencies
# in /opt/cozyebpf/venv) into /var/cache/cozyebpf/vagrant-box/, and added to Vagrant as
# cozyebpf/bookworm-local (scripts/vagrant-box.sh; about 4 minutes, a second when current).
vagrant-box:
	bash scripts/setup.sh --vagrant
	bash scripts/vagrant-box.sh --add

# The Vagrant VM run for real (scripts/vagrant-lab.sh): libvirt's daemons, that box,
# `vagrant up --provider libvirt` (qemu's TCG here) on the lab's isolated network, the packet
# tests (pytest -m packet) and the demo in the VM, `vagrant destroy`, and nothing left; a row
# per step with its time (vagrant/README.md has the figures). Options, e.g.:
# make vagrant-lab VAGRANT_LAB_ARGS='--pytest-args "-k test_port_filter" --no-demo'
vagrant-lab:
	bash scripts/vagrant-lab.sh $(VAGRANT_LAB_ARGS)

bench-setup:
	bash scripts/setup.sh
	$(PYTHON) -m pip install -q -e '.[bench]'

bench: bench-setup
	$(PYTHON) -m bench

bench-quick: bench-setup
	$(PYTHON) -m bench --quick
