"""Benchmarks of cozyebpf: datapath (namespace lab, BPF_PROG_RUN) and control plane, side by side
with cozy-proxy's nftables ruleset and plain routing. Run `make bench` (or `make bench-quick`)
as root from the repository root; see bench/README.md."""
