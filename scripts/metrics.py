"""The Prometheus endpoint: ``/metrics`` of a master or a worker, served on the reactor thread.

The collectors live beside what they measure (``replication.master_metrics``,
``workers.worker_metrics``) and read only the typed ``stats()`` snapshots;
this module only serves them.
"""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site


class MetricsPage(Resource):
    """``/metrics`` rendered on the reactor thread.

    prometheus_client's own Twisted resource collects on a thread pool, where
    the collectors would read the master's connections and streams while the
    reactor changes them; collecting here reads a consistent picture.
    """

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Any) -> bytes:
        # The text format, or OpenMetrics when the scraper asks for it.
        accept = (request.getHeader(b"accept") or b"").decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        request.setHeader(b"Content-Type", content_type.encode("ascii"))
        return encoder(self.registry)


def serve_metrics(reactor: Any, collector: Collector, host: str, port: int) -> Any:
    """Listen for ``GET /metrics``; returns the listening port."""
    registry = CollectorRegistry()
    registry.register(collector)
    root = Resource()
    root.putChild(b"metrics", cast(IResource, MetricsPage(registry)))
    return reactor.listenTCP(port, Site(root), interface=host)
