"""Sources of desired state: they return Kubernetes objects as plain dicts for the model."""
