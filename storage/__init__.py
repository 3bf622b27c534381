"""Storage: databases, schema and migrations, tokens, the timestamp oracle.

Everything here is synchronous and knows nothing of sockets or Twisted; the
layers above run these calls on a thread pool. What they may use of it is
defined by the ``typing.Protocol`` s in :mod:`storage.contracts` (returned by
``open_store``, ``open_worker_store`` and ``open_snapshot_reader``), and for
the timeline by :class:`storage.timeline_contract.TimelineStore` (returned by
``storage.timeline_store.open_timeline_store``); SQL stays in this package.
"""
