"""An edge as a real process serving the E2B protocol, the template ``base`` made the way an
operator would make an E2B-style one, and the settings the stock ``e2b`` SDK needs.

The template: an admin project starts the fixture's python image through the native API, adds
E2B's account ``user`` (uid 1000, home ``/home/user``) with ``useradd``, and checkpoints it as
``base``, shared with every project.  The SDK then needs only ``E2B_API_KEY``, ``E2B_API_URL``
and ``E2B_SANDBOX_URL`` (:func:`sdk_env`), as a user's would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .edges import EdgeProcess, running

ADMIN = "ops-token-0123456789"
ALPHA = "alpha-token-0123456789"
BETA = "beta-token-0123456789"
TOKENS = {"projects": {"ops": {"tokens": [ADMIN], "admin": True},
                       "alpha": {"tokens": [ALPHA], "max_sandboxes": 12},
                       "beta": {"tokens": [BETA], "max_sandboxes": 4}}}
TEMPLATE = "base"
SOURCE_IMAGE = "img/python"


@dataclass
class E2bEdge:
    edge: EdgeProcess

    @property
    def url(self) -> str:
        return self.edge.url

    def env(self, key: str = ALPHA) -> dict[str, str]:
        return {"E2B_API_KEY": key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    def sandboxes(self) -> list[str]:
        return self.edge.sandboxes()


def make_template(edge: EdgeProcess, name: str = TEMPLATE, image: str = SOURCE_IMAGE, **options: Any) -> str:
    """An E2B-style template from ``image``: the account ``user``, checkpointed as ``name`` and
    shared (the admin project's native API, as an operator would)."""
    status, _, box = edge.http("POST", "/v1/sandboxes", {"image": image, **options})
    assert status == 201, box
    try:
        status, _, out = edge.http("POST", f"/v1/sandboxes/{box['id']}/exec",
                                   {"cmd": "useradd -m -u 1000 -s /bin/bash user && id -u user"}, timeout=300)
        assert status == 200, out
        assert '"exit_code": 0' in str(out), out
        status, _, ckpt = edge.http("POST", f"/v1/sandboxes/{box['id']}/checkpoint",
                                    {"name": name, "labels": {"layerbox.shared": "true"}}, timeout=300)
        assert status == 201, ckpt
    finally:
        edge.http("DELETE", f"/v1/sandboxes/{box['id']}")
    return str(ckpt["digest"])


@contextlib.contextmanager
def e2b_edge(root: Path, store_url: str, *extra: str, name: str = "e2b", template: str = TEMPLATE,
             **options: Any) -> Iterator[E2bEdge]:
    """An edge with the template (its sandbox made with ``options``, e.g. ``isolation``), and the
    SDK's settings in the environment for the block."""
    with running(name, root, store_url, TOKENS, *extra, token=ADMIN) as edge:
        make_template(edge, template, **options)
        served = E2bEdge(edge)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in served.env().items():
                mp.setenv(key, value)
            yield served
