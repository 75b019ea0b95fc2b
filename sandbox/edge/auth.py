"""Who calls the edge: projects and their bearer tokens (docs/SECURITY.md, "Tenancy").

Tokens file (JSON)::

    {"projects": {"alpha": {"tokens": ["..."], "max_sandboxes": 10, "disabled": false, "admin": false,
                            "egress_protected": false}}}

``egress_protected``: the project's egress rules may open protected ranges (the host, the
sandbox subnet, cloud metadata: docs/SECURITY.md, "Protected destinations").

An edge of a fleet (``trust``) takes no tokens: gateways check them and vouch for the caller in
a signed header (sandbox.edge.trust) that the edge's middleware verifies on every request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from sandbox.core.errors import ApiError, InvalidField
from sandbox.core.model import check_object, check_project
from sandbox.edge.trust import Caller, GatewayTrust

DEFAULT_QUOTA = 10
CALLER = "layerbox.caller"  # the request key where an edge of a fleet keeps whom the gateway vouched for


@dataclass(frozen=True)
class Project:
    name: str
    max_sandboxes: int = DEFAULT_QUOTA
    disabled: bool = False
    admin: bool = False  # may publish shared refs and read /metrics (an operator's project)
    egress_protected: bool = False  # its sandboxes' egress rules may open protected ranges


def _flag(field: str, value: object) -> bool:
    # strictly a boolean: bool("false") is True, and these grant rights
    if not isinstance(value, bool):
        raise InvalidField(field, f"{value!r} is not true or false")
    return value


@dataclass
class AuthConfig:
    """Bearer token -> project."""

    tokens: dict[str, Project] = field(default_factory=dict)
    trust: GatewayTrust | None = None  # an edge of a fleet: callers come vouched for by gateways
    _vouched: dict[str, Project] = field(default_factory=dict)  # projects gateways named lately, by name

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> AuthConfig:
        """From the tokens file's object; a malformed one is :class:`InvalidField` naming where."""
        out: dict[str, Project] = {}
        for name, spec in (doc.get("projects") or {}).items():
            check_project(name, "projects")
            check_object(f"projects.{name}", spec, ("tokens", "max_sandboxes", "disabled", "admin",
                                                    "egress_protected"))
            quota = spec.get("max_sandboxes", DEFAULT_QUOTA)
            if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
                raise InvalidField(f"projects.{name}.max_sandboxes", "must be a non-negative integer")
            flags = {key: _flag(f"projects.{name}.{key}", spec.get(key, False))
                     for key in ("disabled", "admin", "egress_protected")}
            project = Project(name, quota, **flags)
            for token in spec.get("tokens") or []:
                if not isinstance(token, str) or len(token) < 16:
                    raise InvalidField(f"projects.{name}.tokens", "tokens are strings of at least 16 characters")
                if token in out:
                    raise InvalidField(f"projects.{name}.tokens", f"a token is shared with project "
                                                                 f"{out[token].name!r}")
                out[token] = project
        return cls(out)

    @classmethod
    def load(cls, path: str | Path) -> AuthConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def authenticate(self, request: web.Request) -> Project:
        """The project of the request's ``Authorization: Bearer <token>`` (401 unknown, 403 disabled),
        or on an edge of a fleet the one its gateway vouched for."""
        if self.trust is not None:
            caller: Caller | None = request.get(CALLER)
            if caller is None:
                raise ApiError(None, "unauthenticated", "the gateway named no caller for this request")
            return self.vouched(caller)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(None, "unauthenticated", "missing 'Authorization: Bearer <token>' header")
        return self.project_of(token.strip())

    def vouched(self, caller: Caller) -> Project:
        project = Project(caller.name, caller.max_sandboxes, admin=caller.admin,
                          egress_protected=caller.egress_protected)
        self._vouched[caller.name] = project
        return project

    def has_caller(self, request: web.Request) -> bool:
        """Whether a gateway vouched for a project on this request (an edge of a fleet)."""
        return request.get(CALLER) is not None

    def project_of(self, token: str) -> Project:
        """The project ``token`` belongs to (401 unknown, 403 disabled)."""
        if self.trust is not None:
            raise ApiError(None, "unauthenticated", "this edge serves a fleet: its gateways check tokens")
        project = self.tokens.get(token)
        if project is None:
            raise ApiError(None, "unauthenticated", "unknown token")
        return _enabled(project)

    def named(self, name: str) -> Project | None:
        """The project called ``name`` as this edge knows it, if it does."""
        if self.trust is not None:  # gateways vouch for projects; one not seen since a restart has defaults
            return self._vouched.get(name) or (Project(name, DEFAULT_QUOTA) if name else None)
        return next((p for p in self.tokens.values() if p.name == name), None)

    def project_named(self, name: str) -> Project:
        """The project called ``name`` (of a sandbox's record); 403 when disabled or no longer listed."""
        project = self.named(name)
        if project is None:
            raise ApiError(None, "forbidden", f"project {name!r} is no longer configured on this edge")
        return _enabled(project)


def _enabled(project: Project) -> Project:
    if project.disabled:
        raise ApiError(None, "forbidden", f"project {project.name!r} is disabled")
    return project
