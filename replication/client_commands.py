"""What the master does with the commands workers send it.

Defaults: the master keeps which users are syncing on which worker instance
(dropped on ``CLEAR_USER_SYNC`` or when the connection closes), the token
each instance acknowledged with ``FEDERATION_ACK``, relays
``REMOTE_SERVER_UP`` to every other connection, and calls registered
callbacks for each command (for example to act on ``REMOVE_PUSHER``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from replication.commands import (
    ClearUserSyncCommand,
    Command,
    FederationAckCommand,
    RemoteServerUpCommand,
    RemovePusherCommand,
    UserSyncCommand,
)

if TYPE_CHECKING:
    from replication.master import Master
    from replication.server import ServerProtocol

logger = logging.getLogger(__name__)

Callback = Callable[["ServerProtocol", Command], Any]


class ClientCommandHandlers:
    def __init__(self, master: Master) -> None:
        self._master = master
        # instance -> user_id -> last_sync_ms, for users currently syncing
        self.syncing_users: dict[str, dict[str, int]] = defaultdict(dict)
        self.federation_acks: dict[str, int] = {}
        self.removed_pushers: list[tuple[str, str, str]] = []
        self._instances_by_conn: dict[ServerProtocol, set[str]] = defaultdict(set)
        self._callbacks: dict[str, list[Callback]] = defaultdict(list)

    def register(self, command_name: str, callback: Callback) -> None:
        """Call ``callback(connection, command)`` for every such command received."""
        self._callbacks[command_name].append(callback)

    def _notify(self, conn: ServerProtocol, command: Command) -> None:
        for callback in self._callbacks.get(command.NAME, ()):
            try:
                callback(conn, command)
            except Exception:
                logger.exception("[%s] handler for %s failed", conn.conn_name, command.NAME)

    def user_sync(self, conn: ServerProtocol, command: UserSyncCommand) -> None:
        self._instances_by_conn[conn].add(command.instance)
        users = self.syncing_users[command.instance]
        if command.is_syncing:
            users[command.user_id] = command.last_sync_ms
        else:
            users.pop(command.user_id, None)
        self._notify(conn, command)

    def clear_user_sync(self, conn: ServerProtocol, command: ClearUserSyncCommand) -> None:
        self.syncing_users.pop(command.instance, None)
        self._notify(conn, command)

    def federation_ack(self, conn: ServerProtocol, command: FederationAckCommand) -> None:
        previous = self.federation_acks.get(command.instance, 0)
        self.federation_acks[command.instance] = max(previous, command.token)
        self._notify(conn, command)

    def remove_pusher(self, conn: ServerProtocol, command: RemovePusherCommand) -> None:
        logger.info(
            "[%s] remove pusher %s %s for %s", conn.conn_name, command.app_id, command.push_key, command.user_id
        )
        self.removed_pushers.append((command.app_id, command.push_key, command.user_id))
        del self.removed_pushers[:-1000]
        self._notify(conn, command)

    def remote_server_up(self, conn: ServerProtocol, command: RemoteServerUpCommand) -> None:
        data = command.encode()
        for other in list(self._master.connections):
            if other is not conn and other.authenticated:
                other.write(data)
        self._notify(conn, command)

    def connection_lost(self, conn: ServerProtocol) -> None:
        for instance in self._instances_by_conn.pop(conn, ()):
            self.syncing_users.pop(instance, None)

    def users_syncing(self) -> dict[str, list[str]]:
        return {instance: sorted(users) for instance, users in self.syncing_users.items() if users}
