"""Storage: databases, schema and migrations, tokens, the timestamp oracle.

Everything here is synchronous and knows nothing of sockets or Twisted; the
layers above run these calls on a thread pool.
"""
