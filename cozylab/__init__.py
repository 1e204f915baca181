"""The labs: what proves cozyebpf and measures it, kept out of the product.

Network namespaces with a node, a client and pods (`netns`), the three-node model of a Cozystack
cluster (`cluster`, `make cluster-lab`), the demo (`demo`, `scripts/demo.sh`), the Kubernetes API
double (`kubeapi`) and the objects the labs write to it (`k8s`), and the fake datapath the
controller tests program (`fakedp`). `tests/` and `bench/` import it; it imports nothing from
them. It is not installed by the wheel and not copied into the image: `cozyebpf/` is the
product (what the DaemonSet and the CLI run), and tests/unit/test_packaging.py holds that.
"""
