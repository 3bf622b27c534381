"""What the master does with the commands workers send it.

Defaults: the master keeps which users are syncing on which worker instance
(dropped on ``CLEAR_USER_SYNC`` or when the connection closes), the token
each instance acknowledged with ``FEDERATION_ACK`` (forgotten when the
connection that sent it closes), relays ``REMOTE_SERVER_UP`` to every other
connection that reads (a peer that does not read misses the relay), and calls
registered callbacks for each command (for example to act on
``REMOVE_PUSHER``).

Everything a peer makes the master keep is bounded (``replication.limits``):
names are at most ``max_name_bytes``, one connection uses at most
``max_instances_per_connection`` instance names and marks at most
``max_users_per_connection`` users as syncing. A command past a limit gets
``ERROR <COMMAND> refused: ...`` and is ignored; the connection stays open.
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
from replication.limits import LIMIT_STATS, too_long

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
        self._acks_by_conn: dict[ServerProtocol, set[str]] = defaultdict(set)
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

    # -- limits ----------------------------------------------------------------------

    def _refuse(self, conn: ServerProtocol, command: Command, reason: str, problem: str) -> None:
        LIMIT_STATS.rejected[reason] += 1
        conn.send_error(f"{command.NAME} refused: {problem}")

    def _names_ok(self, conn: ServerProtocol, command: Command, **names: str) -> bool:
        problem = too_long(conn.limits, **names)
        if problem is not None:
            self._refuse(conn, command, "name_bytes", problem)
            return False
        return True

    def _instance_ok(self, conn: ServerProtocol, command: Command, instance: str, kept: set[str]) -> bool:
        """A new instance name for ``conn`` is within max_instances_per_connection."""
        if instance in kept:
            return True
        used = self._instances_by_conn.get(conn, set()) | self._acks_by_conn.get(conn, set())
        limit = conn.limits.max_instances_per_connection
        if instance not in used and len(used) >= limit:
            self._refuse(conn, command, "instances", f"this connection already uses {limit} instance names")
            return False
        return True

    # -- commands --------------------------------------------------------------------

    def user_sync(self, conn: ServerProtocol, command: UserSyncCommand) -> None:
        if not self._names_ok(conn, command, instance=command.instance, user_id=command.user_id):
            return
        mine = self._instances_by_conn.get(conn, set())
        if not self._instance_ok(conn, command, command.instance, mine):
            return
        users = self.syncing_users.get(command.instance, {})
        if command.is_syncing and command.user_id not in users:
            limit = conn.limits.max_users_per_connection
            if sum(len(self.syncing_users.get(i, ())) for i in mine) >= limit:
                self._refuse(conn, command, "users", f"this connection already has {limit} users syncing")
                return
        self._instances_by_conn[conn].add(command.instance)
        users = self.syncing_users[command.instance]
        if command.is_syncing:
            users[command.user_id] = command.last_sync_ms
        else:
            users.pop(command.user_id, None)
        self._notify(conn, command)

    def clear_user_sync(self, conn: ServerProtocol, command: ClearUserSyncCommand) -> None:
        if not self._names_ok(conn, command, instance=command.instance):
            return
        self.syncing_users.pop(command.instance, None)
        self._notify(conn, command)

    def federation_ack(self, conn: ServerProtocol, command: FederationAckCommand) -> None:
        if not self._names_ok(conn, command, instance=command.instance):
            return
        if not self._instance_ok(conn, command, command.instance, self._acks_by_conn.get(conn, set())):
            return
        self._acks_by_conn[conn].add(command.instance)
        previous = self.federation_acks.get(command.instance, 0)
        self.federation_acks[command.instance] = max(previous, command.token)
        self._notify(conn, command)

    def remove_pusher(self, conn: ServerProtocol, command: RemovePusherCommand) -> None:
        if not self._names_ok(conn, command, app_id=command.app_id, push_key=command.push_key, user_id=command.user_id):
            return
        conn.peer_log(
            logging.INFO,
            "remove pusher %s %s for %s",
            command.app_id,
            command.push_key,
            command.user_id,
            log=logger,
        )
        self.removed_pushers.append((command.app_id, command.push_key, command.user_id))
        del self.removed_pushers[:-1000]
        self._notify(conn, command)

    def remote_server_up(self, conn: ServerProtocol, command: RemoteServerUpCommand) -> None:
        if not self._names_ok(conn, command, server=command.server):
            return
        data = command.encode()
        for other in list(self._master.connections):
            if other is not conn and other.authenticated:
                other.relay(data)  # dropped for a peer that does not read
        self._notify(conn, command)

    def connection_lost(self, conn: ServerProtocol) -> None:
        for instance in self._instances_by_conn.pop(conn, ()):
            self.syncing_users.pop(instance, None)
        for instance in self._acks_by_conn.pop(conn, ()):
            # Forget the ack unless another open connection acknowledged it too.
            if not any(instance in acks for acks in self._acks_by_conn.values()):
                self.federation_acks.pop(instance, None)

    def users_syncing(self) -> dict[str, list[str]]:
        return {instance: sorted(users) for instance, users in self.syncing_users.items() if users}
