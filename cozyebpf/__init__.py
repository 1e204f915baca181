"""cozyebpf: a LoadBalancer IP as a whole for one pod, as stateless 1:1 NAT in eBPF."""

__version__ = "0.3.0"
