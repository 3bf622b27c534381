"""What the master and workers hand to the reactor declares the interfaces the reactor drives."""

from __future__ import annotations

from twisted.internet.interfaces import IReadDescriptor, IWriteDescriptor
from zope.interface.verify import verifyClass

from replication.master import NotificationReader
from replication.pg_async import AsyncQuery


def test_notification_reader_is_a_read_descriptor() -> None:
    assert verifyClass(IReadDescriptor, NotificationReader)


def test_async_query_is_a_read_and_write_descriptor() -> None:
    assert verifyClass(IReadDescriptor, AsyncQuery)
    assert verifyClass(IWriteDescriptor, AsyncQuery)
