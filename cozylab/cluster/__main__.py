"""`python -m cozylab.cluster`: the lab's command line (cozylab/cluster/report.py)."""

from cozylab.cluster.report import main

main()
