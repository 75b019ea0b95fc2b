"""No DNS for a Python process started with this directory first on its ``PYTHONPATH``.

Python imports ``sitecustomize`` at start-up (the ``site`` module), before the program runs;
this one replaces ``socket.getaddrinfo`` with one that answers numeric hosts and
``localhost`` only, and refuses every other name as the resolver would, with :data:`REFUSAL`
in the message.  The fuzzed edge (tests/test_sandbox_fuzz.py) resolves the host names of
fuzzed egress rules: they never reach the host's resolver, and the service has no test hook.
"""

from __future__ import annotations

import socket
from typing import Any

REFUSAL = "the fuzz test resolves numeric hosts and localhost only"

_real_getaddrinfo = socket.getaddrinfo


def local_getaddrinfo(host: Any, port: Any = None, family: int = 0, type: int = 0, proto: int = 0,
                      flags: int = 0) -> Any:
    """Numeric hosts and localhost only: host names never leave this machine."""
    if host in ("localhost", b"localhost"):
        host = "127.0.0.1"
    try:
        return _real_getaddrinfo(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)
    except socket.gaierror:
        raise socket.gaierror(socket.EAI_NONAME, f"Name or service not known ({REFUSAL})") from None


socket.getaddrinfo = local_getaddrinfo
