"""The real-node lab (issue 44): the chart's DaemonSet and the backends run as Pods on real
nodes, each a kubelet and a container runtime in a network namespace of its own.

(The package's full description is written with the lab; see lab.py.)
"""
