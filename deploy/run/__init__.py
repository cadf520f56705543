"""Targets on this machine: local processes (`run --local`) and Docker containers made as the
Kubernetes controllers would make the pods (`run --docker`)."""
