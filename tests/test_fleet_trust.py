"""Gateway -> edge signatures (sandbox.edge.trust) at the rates a fleet signs them: many requests
alike in the same millisecond, and more in the replay window than the edge prunes at."""

from __future__ import annotations

import time

import pytest

from sandbox.core.errors import ApiError
from sandbox.edge.trust import SEEN_PRUNE, Caller, GatewayTrust, sign_request

KEY = bytes(range(32))
CALLER = Caller("demo", 100)


def test_the_same_create_signed_twice_in_one_millisecond_is_two_requests() -> None:
    """Two creates of one project to one edge at the same instant (a burst through one gateway, or
    two): both pass; each header, sent again, is refused."""
    trust, now = GatewayTrust(KEY), time.time()
    first, second = (sign_request(KEY, "POST", "/v1/sandboxes", CALLER, now) for _ in range(2))
    assert first != second
    for header in (first, second):
        assert trust.verify(header, "POST", "/v1/sandboxes") == CALLER
    for header in (first, second):
        with pytest.raises(ApiError, match="replayed"):
            trust.verify(header, "POST", "/v1/sandboxes")
    stamp = float(first.split(";")[1])
    assert now - 0.001 <= stamp <= now + 0.001  # still the signing time


def test_every_header_in_the_window_is_remembered_past_the_pruning_bound() -> None:
    trust, now = GatewayTrust(KEY), time.time()
    headers = [sign_request(KEY, "GET", f"/v1/sandboxes/{i}", CALLER, now) for i in range(3 * SEEN_PRUNE)]
    for i, header in enumerate(headers):
        assert trust.verify(header, "GET", f"/v1/sandboxes/{i}") == CALLER
    for i in (0, SEEN_PRUNE, len(headers) - 1):
        with pytest.raises(ApiError, match="replayed"):
            trust.verify(headers[i], "GET", f"/v1/sandboxes/{i}")
