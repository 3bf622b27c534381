"""Storage: databases, schema and migrations, tokens, the timestamp oracle.

Everything here is synchronous and knows nothing of sockets or Twisted; the
layers above run these calls on a thread pool. What they may use of it is
defined by the ``typing.Protocol`` s in :mod:`storage.contracts` (returned by
``open_store``, ``open_worker_store`` and ``open_snapshot_reader``); SQL
stays in this package.
"""
