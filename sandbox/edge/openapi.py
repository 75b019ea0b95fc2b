"""The edge service's OpenAPI document, its request schemas derived from :mod:`sandbox.core.model`.

The bounds here are the model's own (what a sandbox can be at all); an edge's
:class:`~sandbox.core.model.Maxima` may refuse less with a 400 naming the field.
``tests/test_sandbox_fuzz.py`` runs schemathesis against this document and the
real service: every request it generates must answer without a 5xx and in time.
"""

from __future__ import annotations

from typing import Any

from sandbox.core import model as m

# OpenAPI 3.0 has JSON Schema draft 4's exclusive bounds: a boolean beside minimum, not a number
_POSITIVE = {"type": "number", "minimum": 0, "exclusiveMinimum": True}
_SECONDS = {**_POSITIVE, "maximum": 365 * m.DAY}
_NO_NUL = r"^[^\x00]*$"
_PATH = {"type": "string", "pattern": r"^/[^\x00]*$", "maxLength": m.MAX_PATH}
# OpenAPI 3.0 has no propertyNames: the key grammars are prose (a bad key is a 400 naming the field)
_ENV = {"type": "object", "additionalProperties": {"type": "string", "pattern": _NO_NUL},
        "maxProperties": m.MAX_ENV_ENTRIES, "description": "names: 1-256 characters without '=' or NUL"}
_LABELS = {"type": "object", "maxProperties": m.MAX_LABELS,
           "additionalProperties": {"type": "string", "maxLength": 1024, "pattern": _NO_NUL},
           "description": "keys: 1-128 letters, digits, '.', '_', '/', '-', starting with a letter or digit; "
                          "not under 'layerbox.'"}
_PRINTABLE = {"type": "string", "pattern": "^" + m.PRINTABLE.pattern + "$"}
_ARGV = {"type": "array", "items": {"type": "string", "pattern": _NO_NUL}, "minItems": 1, "maxItems": m.MAX_ARGS,
         "description": "argv: the program name first (not empty)"}
_COMMAND = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": m.MAX_COMMAND_BYTES, "pattern": _NO_NUL,
                       "description": "run by /bin/sh -c"}, _ARGV]}
_PORT = r"(6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})"

EGRESS_RULE = {
    "type": "object", "additionalProperties": False,
    "description": "exactly one of cidr (a network without host bits, or an address) or host (resolved when "
                   "the policy is set); ports, a port or a low-high range, only with tcp (the default) or udp. "
                   "A rule overlapping a protected range (the host, the sandbox subnet, loopback, link-local and "
                   "metadata, broadcast, multicast, the operator's) is a 400 unless the operator allows the "
                   "project; 0.0.0.0/0 and ::/0 reach every other address",
    "properties": {
        "cidr": {"type": "string", "example": "203.0.113.0/24"},
        "host": {"type": "string", "example": "pypi.org"},
        "ports": {"oneOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
                            {"type": "string", "pattern": f"^{_PORT}(-{_PORT})?$"}]},
        "protocol": {"type": "string", "enum": list(m.PROTOCOLS)},
    },
    "oneOf": [{"required": ["cidr"]}, {"required": ["host"]}],
    "anyOf": [{"not": {"required": ["ports"]}}, {"properties": {"protocol": {"enum": ["tcp", "udp"]}}}],
}

OPTIONS_PROPERTIES: dict[str, Any] = {
    "cpu": {**_POSITIVE, "maximum": 1024, "description": "CPUs of quota"},
    "memory": {"type": "integer", "minimum": m.MIN_MEMORY, "maximum": 64 * m.TiB, "description": "bytes"},
    "pids": {"type": "integer", "minimum": m.MIN_PIDS, "maximum": 1 << 22},
    "disk": {"type": "integer", "minimum": m.MIN_DISK, "maximum": 1024 * m.TiB, "nullable": True,
             "description": "bytes of the sandbox's own writable disk"},
    "cpu_class": {"type": "string", "enum": list(m.CPU_CLASSES)},
    "env": _ENV,
    "workdir": _PATH,
    "user": {"type": "string", "pattern": "^" + m.USER_SPEC.pattern + "$"},
    "labels": _LABELS,
    "ttl": _SECONDS, "idle_timeout": _SECONDS, "lease_ttl": _SECONDS,
    "job": {"type": "string", "pattern": "^" + m.JOB_NAME.pattern + "$"},
    "network": {"type": "array", "items": EGRESS_RULE, "maxItems": m.MAX_RULES, "nullable": True,
                "description": "egress allow rules (default deny); null or absent: loopback only"},
    "userns": {"type": "boolean"},
    "policy_version": {**_PRINTABLE, "maxLength": 128},
    "isolation": {"type": "string", "enum": list(m.ISOLATIONS),
                  "description": "container (crun), microvm (QEMU's microvm machine, its own guest kernel) or "
                                 "vm (a full q35 VM); /v1/capabilities says which this edge runs"},
    "kernel": {"type": "string", "enum": list(m.KERNELS),
               "description": "which kernel a VM boots: layerbox's guest kernel, or (isolation=vm) the "
                              "image's own /vmlinuz with its /lib/modules"},
}
assert set(OPTIONS_PROPERTIES) == set(m.SandboxOptions.CLIENT_FIELDS)

_REF = {"type": "string", "minLength": 1, "maxLength": 512}
_COUNT = {"type": "integer", "minimum": 1, "maximum": m.MAX_FORK, "description": "sandboxes to make (at most the "
          "edge's maximum); with count, a restore answers {sandboxes: [...]}"}


def _body(properties: dict[str, Any], required: tuple[str, ...] = (), **more: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties, **more}
    if required:
        schema["required"] = list(required)
    return {"required": bool(required), "content": {"application/json": {"schema": schema}}}


SCHEMAS: dict[str, dict[str, Any]] = {
    "create": _body({"image": _REF, **OPTIONS_PROPERTIES}, ("image",)),
    "restore": _body({"checkpoint": _REF, "count": _COUNT, **OPTIONS_PROPERTIES}, ("checkpoint",)),
    "fork": _body({"count": _COUNT, **OPTIONS_PROPERTIES}),
    "ttl": _body({"ttl": {**_SECONDS, "description": "seconds from now; the sandbox's age plus these is at most "
                                                     "the edge's maximum ttl"}}, ("ttl",)),
    "exec": _body({
        "cmd": _COMMAND, "env": _ENV, "cwd": _PATH,
        "timeout": {**_POSITIVE, "maximum": 30 * m.DAY},
        "stdin": {"type": "string", "format": "byte", "description": "base64"},
        "output_cap": {"type": "integer", "minimum": 0, "maximum": m.UNCAPPED, "description": "bytes streamed "
                       "per stream"},
        "idempotency_key": {**_PRINTABLE, "maxLength": 200},
        "keep": {"type": "string", "enum": list(m.KEEPS), "description": "head (default): the first output_cap "
                 "bytes per stream; tail: also the last output_cap bytes, sent when the command ends (at most "
                 "the edge's tail maximum); a truncated event says where output was dropped"},
        "rerun_if_interrupted": {"type": "boolean", "description": "with idempotency_key: run again a command "
                                 "whose earlier run was interrupted, instead of replaying that"},
        "user": {"type": "string", "pattern": "^" + m.USER_SPEC.pattern + "$", "description": "an account of the "
                 "sandbox's /etc/passwd to run as (HOME, USER and the default cwd follow it)"},
    }, ("cmd",)),
    "checkpoint": _body({"name": {"type": "string", "minLength": 1, "maxLength": m.MAX_REF_NAME,
                                  "description": "repo[:tag], inside the project's namespace"},
                         "labels": _LABELS,
                         "memory": {"type": "boolean", "description": "microVMs: the RAM and device state too"}}),
    "network": _body({"rules": {"type": "array", "items": EGRESS_RULE, "maxItems": m.MAX_RULES}}, ("rules",)),
    "renew": _body({"ttl": _SECONDS}),
    "preempt": _body({"timeout": {"type": "number", "minimum": 0, "maximum": 30 * m.DAY,
                                  "description": "grace for running commands"}}),
    "run": _body({"manifest": _REF}, ("manifest",)),
    "port_url": _body({"ttl": {**_POSITIVE, "maximum": 365 * m.DAY, "description": "seconds (default 300)"}}),
    # a command, or a function with its arguments
    "call": _body({"image": _REF, "cmd": _COMMAND,
                   "function": {"type": "string", "minLength": 1, "pattern": _NO_NUL,
                                "description": "Python source (at most 1 MiB)"},
                   "args": {"type": "array"}, "kwargs": {"type": "object"},
                   "timeout": {**_POSITIVE, "maximum": 30 * m.DAY}}, ("image",),
                  oneOf=[{"required": ["cmd"], "not": {"anyOf": [{"required": [k]} for k in ("function", "args",
                                                                                                 "kwargs")]}},
                         {"required": ["function"], "not": {"required": ["cmd"]}}]),
}

_FLAG = {"type": "string", "enum": ["0", "1", "true", "false"]}
PARAMETERS: dict[str, dict[str, Any]] = {
    "id": {"type": "string", "pattern": "^" + m.SANDBOX_ID.pattern + "$"},
    "job": {"type": "string", "pattern": "^" + m.JOB_NAME.pattern + "$"},
    "path": _PATH, "list": _FLAG, "stat": _FLAG, "recursive": _FLAG,
    "mode": {"type": "string", "pattern": "^0?[0-7]{1,3}$", "description": "octal permission bits"},
    "since": {"type": "number", "minimum": 0, "maximum": 1e12, "description": "Unix time"},
    "label": {"type": "array", "items": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}=[^\x00]*$"},
              "description": "key=value; every one given must match"},
    "state": {"type": "string", "enum": list(m.STATUSES)},
    "name": {"type": "string", "pattern": "^projects/[^\x00]+$", "maxLength": m.MAX_REF_NAME + 256,
             "description": "the checkpoint's full ref name, as GET /v1/checkpoints lists it"},
    "action": {"type": "string"}, "idempotency_key": {"type": "string"},
    "port": {"type": "integer", "minimum": 1, "maximum": 65535, "description": "a TCP port inside the sandbox"},
    "tail": {"type": "string", "description": "the path the sandbox's server is asked for (after the prefix; "
                                              "may hold '/'; the query string is kept)"},
    "expires": {"type": "integer", "minimum": 0, "maximum": 10**12 - 1, "description": "Unix time"},
    "signature": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
}

_ERRORS = {"400": "a field is malformed or out of range (error.field names it)",
           "401": "missing or unknown token", "403": "project disabled, or not allowed"}
# what one project may hold at once (sandbox/edge/caps.py): error.resources names the cap
_PROJECT_CAP = "a cap of the project reached (code 'project_limit', retryable; error.resources names it: {})"


def _op(summary: str, responses: dict[str, str], *, body: str | None = None, query: tuple[str, ...] = (),
        path: str | None = "id") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "security": [{"bearer": []}],
                          "responses": {code: {"description": d, **_error_content(code)}
                                        for code, d in {**responses, **_ERRORS}.items()}}
    params: list[dict[str, Any]] = []
    if path is not None:
        params.append({"name": path, "in": "path", "required": True, "schema": PARAMETERS[path]})
        op["responses"].setdefault("404", {"description": "no such sandbox (or job) in this project",
                                           **_error_content("404")})
    params += [{"name": q, "in": "query", "required": q == "path", "schema": PARAMETERS[q]} for q in query]
    if params:
        op["parameters"] = params
    if body == "bytes":
        op["requestBody"] = {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}
    elif body is not None:
        op["requestBody"] = SCHEMAS[body]
        op["responses"]["413"] = {"description": "the JSON body is over 4 MiB (code 'body_too_large')",
                                  **_error_content("413")}
    return op


def _error_content(code: str) -> dict[str, Any]:
    if not code.startswith(("4", "5")):
        return {}
    return {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _port_ops(summary: str, extra: tuple[str, ...] = (), *, signed: bool = False) -> dict[str, Any]:
    """The proxy's operations, one per method (HEAD too is served, and not listed): any response of the
    sandbox's server is relayed; the edge's own errors are JSON."""
    ops: dict[str, Any] = {}
    for method in ("get", "post", "put", "patch", "delete", "options"):
        op = _op(summary, {"default": "the response of the sandbox's server, relayed",
                           "101": "a WebSocket (GET with Upgrade: websocket), relayed message by message",
                           "409": "the sandbox is not running", "429": "too many proxied connections open "
                           "to this sandbox (retryable), or " + _PROJECT_CAP.format("connections"), "502": "nothing listens on the port inside the "
                           "sandbox (code 'port_closed'), or no valid response", "504": "the port did not "
                           "accept or answer in time"}, body="bytes" if method in ("post", "put", "patch") else None)
        op["parameters"] += [{"name": p, "in": "path", "required": True, "schema": PARAMETERS[p]}
                             for p in ("port", *extra, "tail")]
        if signed:
            op["security"] = []
            op["responses"]["403"]["description"] = "the signature does not match, or expired; project disabled"
        ops[method] = op
    return ops


_PORT_URL = _op("A signed URL to the port (ttl: seconds, at most the edge's maximum, 1 h by default) that "
                "needs no token until it expires", {"200": "url, path (relative to this edge), expires"},
                body="port_url")
_PORT_URL["parameters"].append({"name": "port", "in": "path", "required": True, "schema": PARAMETERS["port"]})

_CREATED = {"201": "the sandbox", "404": "no such image or checkpoint visible to this project",
            "409": "policy or digests differ", "429": "project quota reached (retryable, Retry-After; error.resources is [\"sandboxes\"]), or the "
                   "project has the most jobs this edge keeps leases for (code 'job_limit')",
            "503": "edge out of capacity (code 'capacity', retryable, Retry-After; error.resources names what "
                   "is short)"}

DOCUMENT: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "layerbox sandbox service", "version": "1"},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["code", "message", "retryable"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                           "retryable": {"type": "boolean"}, "field": {"type": "string"},
                           "resources": {"type": "array", "items": {"type": "string"}}}}}}},
    },
    "paths": {
        "/v1/sandboxes": {
            "post": _op("Create a sandbox from an image, composition or checkpoint of this project",
                        _CREATED, body="create", path=None),
            "get": _op("List this project's sandboxes, filtered on labels (label=key=value, repeatable) and status "
                       "(state)", {"200": "sandboxes"}, query=("label", "state"), path=None),
        },
        "/v1/sandboxes/{id}": {
            "get": _op("Describe a sandbox", {"200": "the sandbox"}),
            "delete": _op("Destroy a sandbox", {"204": "destroyed"}),
        },
        "/v1/sandboxes/{id}/exec": {
            "post": _op("Run a command; the response streams newline-delimited JSON events: stdout/stderr "
                        "(base64 data, at most output_cap bytes each), truncated (stream, offset, dropped_bytes, keep) "
                        "where output was dropped, then exit (with interrupted, replayed) "
                        "or error. Closing the connection kills the command.",
                        {"200": "application/x-ndjson event stream",
                         "409": "sandbox not running, job preempted or key still running (retryable)",
                         "429": _PROJECT_CAP.format("commands"),
                         "503": "this edge is stopping (code 'stopping', retryable)"},
                        body="exec"),
        },
        "/v1/sandboxes/{id}/files": {
            "get": _op("Read a regular file (streamed), list a directory with list=1, or stat=1 for one entry's "
                       "type, size, mode, owner and mtime (a symlink itself)",
                       {"200": "bytes or JSON", "403": "the path leaves the sandbox", "404": "no such file",
                        "409": "not a regular file or directory", "429": _PROJECT_CAP.format("transfers")},
                       query=("path", "list", "stat")),
            "put": _op("Write a regular file (mode: octal permission bits)", {"201": "written", "409": "not a "
                       "regular file", "429": _PROJECT_CAP.format("transfers")}, body="bytes", query=("path", "mode")),
            "delete": _op("Remove a file or (recursive=1) a directory", {"204": "removed", "404": "no such file"},
                          query=("path", "recursive")),
        },
        "/v1/sandboxes/{id}/pause": {"post": _op("Freeze the sandbox and reclaim its memory",
                                                 {"200": "reclaim report", "409": "not running"})},
        "/v1/sandboxes/{id}/resume": {"post": _op("Thaw a paused sandbox", {"200": "the sandbox",
                                                                            "409": "not paused"})},
        "/v1/sandboxes/{id}/checkpoint": {"post": _op("Checkpoint the rootfs into the store (name in the "
                                                      "project's namespace, labels)",
                                                      {"201": "the checkpoint", "409": "not running"},
                                                      body="checkpoint")},
        "/v1/sandboxes/restore": {"post": _op("Start a sandbox on a checkpoint of this project (checkpoint, "
                                              "policy_version, and create's options)", _CREATED, body="restore",
                                              path=None)},
        "/v1/sandboxes/{id}/receipts": {"get": _op("The sandbox's receipts still kept (its log's last segments), "
                                                   "oldest first (filters: action, since, idempotency_key)", {"200": "receipts"},
                                                   query=("action", "since", "idempotency_key"))},
        "/v1/sandboxes/{id}/network": {"put": _op("Replace the egress allow rules while the sandbox runs",
                                                  {"200": "the effective policy", "409": "created without a "
                                                   "network"}, body="network")},
        "/v1/sandboxes/{id}/ports/{port}/url": {"post": _PORT_URL},
        "/v1/sandboxes/{id}/ports/{port}/proxy/{tail}": _port_ops(
            "HTTP or WebSocket to 127.0.0.1:{port} inside the sandbox's own network namespace; the bearer "
            "token is not forwarded"),
        "/v1/sandboxes/{id}/ports/{port}/signed/{expires}/{signature}/{tail}": _port_ops(
            "The same through a signed URL (POST .../url), without a token; an Authorization header is the "
            "application's and is forwarded", ("expires", "signature"), signed=True),
        "/v1/jobs/{job}/renew": {"post": _op("Renew the job's lease (ttl)", {
            "200": "the lease", "404": "no sandbox of this job on this edge",
            "429": "the project has the most jobs this edge keeps leases for (code 'job_limit', retryable)"},
            body="renew", path="job")},
        "/v1/jobs/{job}/pause": {"post": _op("Pause every sandbox of the job", {"200": "paused ids"}, path="job")},
        "/v1/jobs/{job}/resume": {"post": _op("Resume every paused sandbox of the job", {"200": "resumed ids"},
                                              path="job")},
        "/v1/jobs/{job}/preempt": {"post": _op("Drain the job (in-flight commands get timeout seconds), "
                                               "checkpoint every sandbox, write a run manifest, free the host",
                                               {"201": "the run"}, body="preempt", path="job")},
        "/v1/runs/resume": {"post": _op("Restore a preempted job of this project from its run manifest; commands "
                                        "are admitted once every sandbox is up",
                                        {**_CREATED, "201": "old -> new sandbox ids",
                                         "404": "no such run in this project"}, body="run", path=None)},
        "/v1/calls": {"post": _op("FnCall: run cmd, or a Python function (function source, args, kwargs), on a "
                                  "warm container of image, in a fresh writable layer",
                                  {"200": "exit code, output (base64), value, error, timings",
                                   "404": "no such image visible to this project",
                                   "429": "project quota reached, or " + _PROJECT_CAP.format("commands"),
                                   "503": "every warm pool of the project busy (at most 4 images at once), or "
                                          "the edge out of capacity (retryable)"},
                                  body="call", path=None)},
        "/v1/capabilities": {"get": _op("What this backend provides (isolation kinds, limits, network, "
                                        "checkpoint kinds); ask for nothing else", {"200": "capabilities"},
                                        path=None)},
        "/v1/load": {"get": _op("Load report: sandboxes live/in flight/max, free memory/pids/disk, load "
                                "average, score, accepting, and what the caller's project holds against its caps "
                                "(commands, transfers, connections)", {"200": "the load report"}, path=None)},
        "/v1/sandboxes/{id}/fork": {"post": _op(
            "Fork: checkpoint the sandbox once and restore it count times on this edge (quota and capacity for "
            "all first; all or none); the forks continue from its files, env, workdir and labels",
            {**_CREATED, "201": "source, checkpoint, sandboxes", "409": "not running or paused"}, body="fork")},
        "/v1/sandboxes/{id}/ttl": {"post": _op("Destroy the sandbox ttl seconds from now (extend or shorten)",
                                               {"200": "the sandbox (ttl: its age at destruction, expires)",
                                                "409": "not running or paused"}, body="ttl")},
        "/v1/sandboxes/{id}/metrics": {"get": _op("CPU seconds, memory now and peak, pids, disk used, and the "
                                                  "commands' recorded resources", {"200": "metrics"})},
        "/v1/checkpoints": {"get": _op("This project's checkpoints", {"200": "checkpoints"}, path=None)},
        "/v1/checkpoints/{name}": {"delete": _op("Delete a checkpoint of this project (its ref; gc removes what "
                                                 "nothing else keeps)", {"204": "deleted",
                                                                         "404": "no such checkpoint in this project"},
                                                 path="name")},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI"}}}},
        "/metrics": {"get": _op("Prometheus metrics (an admin project's token)", {"200": "text"}, path=None)},
    },
}

# -- background commands and terminals (sandbox.edge.commands; its grammar and bounds are checked against these)
COMMAND_PATTERN = "^cmd-[0-9a-f]{12}$"
_WINSIZE = {"type": "integer", "minimum": 1, "maximum": 1000}
_EXEC = SCHEMAS["exec"]["content"]["application/json"]["schema"]["properties"]
SCHEMAS["command"] = _body(
    {**{k: v for k, v in _EXEC.items() if k != "idempotency_key"},
     "pty": {"type": "object", "additionalProperties": False, "required": ["cols", "rows"],
             "properties": {"cols": _WINSIZE, "rows": _WINSIZE},
             "description": "run on a terminal made inside the sandbox (cmd: a login shell by default; TERM "
                            "xterm-256color unless env sets it; output_cap: the edge's maximum by default)"}},
    anyOf=[{"required": ["cmd"]}, {"required": ["pty"]}])
SCHEMAS["stdin"] = _body({"data": {"type": "string", "format": "byte", "description": "base64, at most the edge's "
                                   "write size (1 MiB by default)"},
                          "eof": {"type": "boolean", "description": "then close its input (not for a terminal)"}})
SCHEMAS["resize"] = _body({"cols": _WINSIZE, "rows": _WINSIZE}, ("cols", "rows"))
_IN_COMMAND = [{"name": "command", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": COMMAND_PATTERN}}]
_OFFSET = {"name": "since", "in": "query", "required": False, "schema": {
    "type": "string", "pattern": "^[0-9]{1,18}$", "description": "output offset to replay from (default 0)"}}
_WAIT = {"name": "wait", "in": "query", "required": False, "schema": {
    "type": "number", "minimum": 0, "maximum": 300, "description": "seconds to wait for its exit"}}


def _command_op(summary: str, responses: dict[str, str], *, body: str | None = None,
                query: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    op = _op(summary, responses, body=body)
    op["parameters"] += [*_IN_COMMAND, *query]
    op["responses"]["404"]["description"] = "no such sandbox in this project, or no such command in it"
    return op


_EVENTS = ("events: stdout/stderr (base64 data, offset), dropped (offset, bytes the buffer no longer holds), "
           "then exit (interrupted: killed, destroy, shutdown...) or error")
DOCUMENT["paths"].update({
    "/v1/sandboxes/{id}/commands": {
        "post": _op("Start a background command (an exec body without idempotency_key) or, with pty, a terminal; "
                    "it runs on when clients leave, its input stays open",
                    {"201": "the command (id, status, pty, output offsets)", "409": "sandbox not running or job "
                     "preempted (retryable), or its initial stdin not read in time (retryable)",
                     "429": "the sandbox runs the most background commands or terminals this edge takes "
                     "(retryable), or " + _PROJECT_CAP.format("commands"), "503": "this edge is stopping (code 'stopping', retryable)"}, body="command"),
        "get": _op("The sandbox's background commands: running, and the last finished ones",
                   {"200": "commands"}),
    },
    "/v1/sandboxes/{id}/commands/{command}": {"get": _command_op(
        "Describe a command (status, exit event once it ended); wait: up to that many seconds for its exit",
        {"200": "the command"}, query=(_WAIT,))},
    "/v1/sandboxes/{id}/commands/{command}/output": {"get": _command_op(
        "Its output from since on, what is still kept replayed and then live, as newline-delimited JSON "
        + _EVENTS + "; leaving does not stop the command",
        {"200": "application/x-ndjson event stream", "429": "the most readers are attached (retryable)"},
        query=(_OFFSET,))},
    "/v1/sandboxes/{id}/commands/{command}/connect": {"get": _command_op(
        "A WebSocket: the same " + _EVENTS + " as JSON text messages; the client sends input as binary "
        "messages or {type: stdin, data}, and {type: eof}, {type: resize, cols, rows}, {type: kill}; the "
        "socket closes after the exit",
        {"101": "WebSocket", "400": "not a WebSocket upgrade", "429": "the most readers are attached "
         "(retryable), or " + _PROJECT_CAP.format("connections")}, query=(_OFFSET,))},
    "/v1/sandboxes/{id}/commands/{command}/stdin": {"post": _command_op(
        "Write to its input (waits until it reads, a few seconds at most), eof: then close it",
        {"200": "the command", "409": "it exited, its input is closed, or it did not read in time "
         "(retryable)"}, body="stdin")},
    "/v1/sandboxes/{id}/commands/{command}/resize": {"post": _command_op(
        "Resize a terminal (TIOCSWINSZ; its programs get SIGWINCH)",
        {"200": "the command", "409": "not a terminal, or it exited"}, body="resize")},
    "/v1/sandboxes/{id}/commands/{command}/kill": {"post": _command_op(
        "Kill the command's whole tree (and the orphans it left) under the freezer; answers once it ended",
        {"200": "killed (false: it had ended already) and the command"})},
})
