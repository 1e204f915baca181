"""What the agent asks of and tells the Kubernetes API server, beside the watch of its source
(`cozyebpf/sources/kube.py`): the client itself (`client`: requests through the official
client's ApiClient, the only module that imports the `kubernetes` package), Events on
Services (`events`), the port security of the pods behind a shared device (`portsec`) and who
may read the metrics (`metricsauth`: TokenReview and SubjectAccessReview).

Its layer: above the model, the state and the datapath (it reads records and Problems), beside
the sources, below the agent, the CLI and the servers (metrics, health), none of which it
imports (tests/unit/test_layers.py)."""
