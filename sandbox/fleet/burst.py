"""Cloud bursting with eligibility: which pools a create may use.

The operator's policy (:class:`BurstPolicy`, kept in the fleet database's settings as
``burst``, docs/FORMAT.md "Burst policy") names a home pool (on premises), an overflow pool (the
cloud, whose edges read a store of their own), a utilization threshold (0.8 by default), the
eligibility policy (layerstore.eligibility: ref prefixes and image labels) and how long an
ineligible create may wait for room at home.

Below the threshold every create goes home.  Past it, an image that is eligible *and* present
in the overflow pool's store (``layerbox sync HOME CLOUD --eligible-only`` copied it) goes to the
overflow pool first, home second; any other create stays home, and when home has no room it
waits up to ``wait`` seconds and is then refused with the reason, naming the policy.  Verdicts
are cached for :data:`VERDICT_TTL` seconds per image: a create must not list a store.

What sandboxes in the overflow pool write (checkpoints, sandboxes paused into the store) goes
back: one gateway at a time (:meth:`FleetDb.leader`) copies the overflow store's ``projects/``
refs to the home store every ``--sync-back`` seconds, moving only what home lacks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerstore.eligibility import Eligibility, PolicyError, why_not_eligible
from layerstore.errors import LayerboxError
from layerstore.replicate import SyncReport, replicate
from layerstore.store import Store

SCHEMA = "layerbox.burst.v1"
FIELDS = {"schema", "home", "overflow", "threshold", "wait", "eligibility"}
VERDICT_TTL = 30.0
DEFAULT_THRESHOLD = 0.8
DEFAULT_WAIT = 10.0
PROJECTS = "projects/"  # where checkpoints and paused sandboxes live (per project)


@dataclass(frozen=True)
class BurstPolicy:
    home: str
    overflow: str
    threshold: float = DEFAULT_THRESHOLD
    wait: float = DEFAULT_WAIT
    eligibility: Eligibility = field(default_factory=Eligibility)

    def __post_init__(self) -> None:
        if not (self.home and self.overflow) or self.home == self.overflow:
            raise PolicyError(f"burst policy: home and overflow are two pools, not {self.home!r} and {self.overflow!r}")
        if not (isinstance(self.threshold, int | float) and 0 <= self.threshold <= 1):
            raise PolicyError(f"burst policy: threshold is a fraction from 0 to 1, not {self.threshold!r}")
        if not (isinstance(self.wait, int | float) and 0 <= self.wait <= 300 and math.isfinite(self.wait)):
            raise PolicyError(f"burst policy: wait is 0 to 300 seconds, not {self.wait!r}")

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "home": self.home, "overflow": self.overflow, "threshold": self.threshold,
                "wait": self.wait, "eligibility": self.eligibility.to_json()}

    @classmethod
    def from_json(cls, doc: Any) -> BurstPolicy:
        if not isinstance(doc, Mapping) or doc.get("schema") != SCHEMA:
            raise PolicyError(f"burst policy: want a JSON object with schema {SCHEMA!r}")
        unknown = sorted(set(doc) - FIELDS)
        if unknown:
            raise PolicyError(f"burst policy: unknown field(s) {unknown} (a newer layerbox may have written it)")
        return cls(str(doc.get("home", "")), str(doc.get("overflow", "")),
                   doc.get("threshold", DEFAULT_THRESHOLD), doc.get("wait", DEFAULT_WAIT),
                   Eligibility.from_json(doc.get("eligibility", {"schema": "layerbox.eligibility.v1"}),
                                         "burst policy's eligibility"))

    def describe(self) -> str:
        return (f"burst policy (home {self.home!r}, overflow {self.overflow!r} past {self.threshold:.0%} of home; "
                f"{self.eligibility.describe()})")


class Verdicts:
    """Whether an image may run in a pool: eligible under the policy and present in the pool's store."""

    def __init__(self, stores: Mapping[str, str], data_dir: Path) -> None:
        self.stores = dict(stores)  # pool -> store URL
        self.data_dir = data_dir
        self._open: dict[str, Store] = {}
        self._cache: dict[tuple[str, str, str], tuple[str | None, float]] = {}

    async def why_not(self, policy: BurstPolicy, image: str | None) -> str | None:
        """None when ``image`` may overflow under ``policy``, else why not (naming the policy)."""
        if image is None:
            return f"the create names no image: {policy.describe()}"
        key = (policy.overflow, image, repr(policy.eligibility.to_json()))
        hit = self._cache.get(key)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        verdict = await self._judge(policy, image)
        self._cache[key] = (verdict, time.monotonic() + VERDICT_TTL)
        return verdict

    async def store(self, pool: str) -> Store | None:
        """Pool ``pool``'s store, opened once (None when this gateway was given none)."""
        url = self.stores.get(pool)
        if url is None:
            return None
        store = self._open.get(pool)
        if store is None:
            store = self._open[pool] = await Store.open(url, self.data_dir / pool)
        return store

    async def sync_back(self, policy: BurstPolicy) -> SyncReport | None:
        """Copy what sandboxes of the overflow pool wrote (checkpoints, paused sandboxes: the refs
        under ``projects/``) to the home pool's store; None without both stores."""
        src, dst = await self.store(policy.overflow), await self.store(policy.home)
        if src is None or dst is None:
            return None
        return await replicate(src, dst, [PROJECTS])

    async def _judge(self, policy: BurstPolicy, image: str) -> str | None:
        store = await self.store(policy.overflow)
        if store is None:
            return f"this gateway knows no store for pool {policy.overflow!r} (--pool-store)"
        try:
            reason = await why_not_eligible(store, policy.eligibility, image)
        except LayerboxError as exc:
            return (f"image {image!r} is not in pool {policy.overflow!r}'s store ({type(exc).__name__}: `layerbox "
                    f"sync --eligible-only` copies what the {policy.describe()} allows)")
        if reason is not None:
            return f"image {image!r}: {reason}; {policy.describe()}"
        return None

    async def close(self) -> None:
        for store in self._open.values():
            with contextlib.suppress(Exception):
                await store.close()
        self._open.clear()
