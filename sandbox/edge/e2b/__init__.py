"""The E2B protocol on the edge: the stock ``e2b`` SDK (and what is built on it) against layerbox.

Two surfaces over the same projects, ownership rules, validation, quotas and receipts as the
native API (docs/E2B.md maps every endpoint and field):

- the control plane, E2B's REST API (:mod:`.rest`): ``/sandboxes``, ``/v2/sandboxes``,
  ``/snapshots``, ``/templates``..., authenticated by ``X-API-Key: <project token>``;
- the in-sandbox daemon, envd (:mod:`.envd`): its Connect-RPC ``process`` and ``filesystem``
  services, ``/files``, ``/health``, ``/envs``, ``/metrics``, reached with the headers
  ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` or a host name ``<port>-<id>.<domain>``
  (:mod:`.base`); another port than envd's goes to the sandbox's port proxy.

envd answers for the sandbox in the edge itself: nothing runs in the sandbox for it.
"""
