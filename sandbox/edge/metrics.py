"""The edge's Prometheus metrics: one registry per service (two services in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sandbox.host.admission import RESOURCES


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sandboxes = Gauge("layerbox_sandboxes", "Live sandboxes", ["project", "status"], registry=r)
        self.execs = Counter("layerbox_execs", "Commands run", ["project"], registry=r)
        self.exec_seconds = Histogram("layerbox_exec_duration_seconds", "Command duration", registry=r)
        self.errors = Counter("layerbox_api_errors", "Error responses", ["code"], registry=r)
        self.requests = Counter("layerbox_api_requests", "Requests", ["route", "status"], registry=r)
        self.free = Gauge("layerbox_admission_free", "Free capacity after reserves and creates in flight "
                          "(bytes for memory and disk)", ["resource"], registry=r)
        self.rejected = Counter("layerbox_admission_rejections", "Creates refused for capacity, by the "
                                "first short resource", ["resource"], registry=r)
        self.reaped = Counter("layerbox_reaped", "Sandboxes the reaper acted on", ["action"], registry=r)
        self.preempt_seconds = Histogram("layerbox_preempt_duration_seconds", "Preempting a job, drain to "
                                         "manifest", registry=r)
        self.call_seconds = Histogram("layerbox_fncall_duration_seconds", "FnCall latency (queueing included)",
                                      buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.ready = Gauge("layerbox_ready_sandboxes", "Ready pools (--ready): sandboxes ready now, adopted "
                           "and found stale (their image's ref had moved) since the start", ["image", "what"],
                           registry=r)
        for action in ("destroyed", "paused"):
            self.reaped.labels(action)
        for resource in RESOURCES:  # every series exists from the start, at zero
            self.rejected.labels(resource)
