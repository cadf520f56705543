"""`ddpkit lint`: offline checks of Kubernetes manifests as the API server and the operators'
admission webhooks would make them.

Two floors. Below the Kubernetes flavors, the engines that know no flavor: `report` (findings),
`meta` (ObjectMeta), `core` (core kinds), `schema` and `cel` (CRDs). Above them, what asks the
flavors: `admission` (each flavor's webhook port, in `deploy/k8s/<flavor>/operator.py`),
`advice` (the flavors' training containers) and `command` (files in, findings out: `run_lint`). This
package's own module imports nothing, so a flavor's operator can use the engines without a circle.
"""
