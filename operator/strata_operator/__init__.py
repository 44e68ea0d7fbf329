"""The Strata operator: `StrataDeployment` resources served per hardware profile, configured by autoconfig from each
node's facts. `kopf run -m strata_operator` imports this package, which registers the handlers (docs/OPERATOR.md).

Modules, from the resource to the API: `spec` (the resource's fields), `modelfacts` (what is known of the model),
`profiles` (nodes into hardware profiles, one replica's share), `plan` (autoconfig per profile, the spec's explicit
settings over it), `builders` (ConfigMap, Deployment, Service), `status`, `kube` (the API calls), `handlers` (kopf).
"""

from strata_operator import handlers  # noqa: F401  (registers the kopf handlers)
