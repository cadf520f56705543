"""`ddpkit lint`: offline checks of Kubernetes manifests as the API server and the operators'
admission webhooks would make them.

One floor, above the Kubernetes flavors: `schema` and `cel` (CRDs), `admission` (each flavor's
webhook port, in `deploy/k8s/<flavor>/operator.py`), `advice` (the flavors' training containers),
`report` (a finding placed in a file) and `command` (files in, findings out: `run_lint`). The
engines that the job model and the flavors' operators use too, ObjectMeta and the core kinds'
rules, are below them all in `deploy.kube` (`meta`, `core`, `finding`).
"""
