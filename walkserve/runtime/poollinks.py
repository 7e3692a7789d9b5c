"""The pool's rank links (``runtime.ranklink``): each rank this process spawns talks to it over
one Unix socket, not ZeroMQ's pair (remote ranks keep ZeroMQ). ``pool.WorkerPool`` is a
``PoolLinks``::

    _open_links(tmpdir)        the listener, in the pool's private directory (its path goes to
                               every spawned worker in ``WorkerConfig.link``)
    _write(state, data)        a command to a rank (any thread, under ``_send_lock``): on its
                               link when it has one, else on the command ROUTER; never blocks
    _listen_links(poller)      the io thread, as it starts: the listener polled
    _watch_links(poller)       the io thread, before each poll: what it polls for (POLLOUT
                               where a link holds what its socket did not take)
    _on_link_event(fd, ev)     the io thread: a connection accepted (which rank it is: its
                               process's pid, from the kernel), reports read, the rest written
    _drain_links()             the io thread: what the links hold now (a dead rank's last words)
    _drop_link(state)          its process ended: the link is closed by the io thread

A link's reports are dispatched as the ROUTER's are (``IoLoop._handle``). A command that finds
a link closed fails as a send to a gone ROUTER peer does (``zmq.ZMQError``, EHOSTUNREACH), so
its callers' rules stay one; one that finds the rank's unread commands at the link's bound
(``PoolConfig.link_max_unsent``: the rank reads nothing) fails as a send to a ROUTER peer
whose queue is full does (EAGAIN).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import zmq

from walkserve.runtime.doorbell import Doorbell, bell_path
from walkserve.runtime.poolbatches import NodeBatches
from walkserve.runtime.poolstate import GONE, RankState
from walkserve.runtime.ranklink import Link, LinkClosed, LinkFull, LinkListener

__all__ = ["PoolLinks"]

log = logging.getLogger("walkserve.pool")

_IN, _OUT = zmq.POLLIN, zmq.POLLIN | zmq.POLLOUT
_POLLOUT = int(zmq.POLLOUT)  # as an int: the flag enum's ``&`` costs more than the read


class PoolLinks(NodeBatches):
    """See the module docstring."""

    _ranks: dict[int, RankState]
    _commands: zmq.Socket[bytes]
    _poller: zmq.Poller
    _nudge: Any  # WakePipe

    def _open_links(self, directory: str | None) -> str:
        """Listen for rank links in ``directory`` (None, or links off: none; ranks use
        ZeroMQ): the path workers connect to ("" for none)."""
        from walkserve.runtime import ranklink

        self._listener: LinkListener | None = None
        self._links: dict[int, tuple[RankState, Link]] = {}  # fd -> its rank, the link
        self._writing: set[int] = set()  # fds polled for POLLOUT
        self._dropped: list[Link] = []  # links of ended processes, for the io thread to close
        self._links_lock = threading.Lock()  # ``_dropped``
        if directory is None or not self.config.rank_links or not ranklink.available():
            return ""
        self._listener = LinkListener(os.path.join(directory, "link"))
        return self._listener.path

    def _write(self, state: RankState, data: bytes) -> None:
        """Send ``data`` to ``state``'s process (under ``_send_lock``)."""
        link = state.link
        if link is None:
            self._commands.send_multipart([state.identity, data], zmq.NOBLOCK)
            return
        try:
            if not link.send(data):
                self._nudge.set()  # the io thread writes the rest once the socket takes it
        except LinkClosed as e:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, f"rank {state.rank}: {e}") from e
        except LinkFull as e:  # the rank reads nothing: as ZeroMQ's full queue refuses
            raise zmq.ZMQError(zmq.EAGAIN, f"rank {state.rank} reads no commands: {e}") from e

    # ------------------------------------------------------------------ the io thread

    def _listen_links(self, poller: zmq.Poller) -> None:
        """The io thread polls the listener from its start."""
        if self._listener is not None:
            poller.register(self._listener.fileno(), _IN)

    def _watch_links(self, poller: zmq.Poller) -> None:
        """Close dropped links; poll for POLLOUT where a link holds what its socket did not
        take (and stop once it took it)."""
        if self._dropped:
            with self._links_lock:
                dropped, self._dropped = self._dropped, []
            for link in dropped:
                self._forget(poller, link)
        for fd, (_, link) in self._links.items():
            want = link.pending()
            if want != (fd in self._writing):
                poller.modify(fd, _OUT if want else _IN)
                if want:
                    self._writing.add(fd)
                else:
                    self._writing.discard(fd)

    def _on_link_event(self, fd: int, events: int) -> bool:
        """An event of the io thread's poll on a link or the listener: handled (False: the fd
        is neither)."""
        if self._listener is not None and fd == self._listener.fileno():
            self._accept()
            return True
        entry = self._links.get(fd)
        if entry is None:
            return False
        state, link = entry
        if events & _POLLOUT:
            with contextlib.suppress(LinkClosed):  # read below: its end
                link.flush()
        if events & ~_POLLOUT:
            self._read_link(state, link)
        return True

    def _accept(self) -> None:
        assert self._listener is not None
        while (accepted := self._listener.accept(self.config.link_max_unsent)) is not None:
            link, pid = accepted
            with self._lock:
                state = next(
                    (
                        s
                        for s in self._ranks.values()
                        if s.process.pid == pid and s.status not in GONE
                    ),
                    None,
                )
            if state is None:
                log.warning("a rank link from pid %d, which is no rank of this pool", pid)
                link.close()
                continue
            # its doorbell before anything is written to it (the rank watches it once it has
            # read a message: ``LinkCommands``); without one, the rank polls the socket
            with contextlib.suppress(OSError):
                directory = os.path.dirname(self._listener.path)
                bell = bell_path(directory, state.rank, state.generation)
                link.ring(Doorbell.create(bell, replace=True))
            with self._send_lock:
                old, state.link = state.link, link
            if old is not None:
                self._forget(self._poller, old)
            self._links[link.fileno()] = (state, link)
            self._poller.register(link.fileno(), _IN)

    def _read_link(self, state: RankState, link: Link) -> None:
        for data in link.recv():
            self._handle(state, data)
        if link.closed:  # its process ended (the sentinel says so, and why)
            with self._send_lock:
                if state.link is link:
                    state.link = None
            self._forget(self._poller, link)

    def _drain_links(self) -> None:
        """Dispatch what every link holds now (a dying rank's last words come before its end)."""
        for state, link in list(self._links.values()):
            self._read_link(state, link)

    def _forget(self, poller: zmq.Poller, link: Link) -> None:
        fd = link.fileno()
        entry = self._links.get(fd)
        if entry is not None and entry[1] is link:  # not a later link under a reused fd
            del self._links[fd]
            poller.unregister(fd)
            self._writing.discard(fd)
        link.close()

    def _drop_link(self, state: RankState) -> None:
        """``state``'s process ended: its link is closed (by the io thread while it runs)."""
        with self._send_lock:
            link, state.link = state.link, None
        if link is None:
            return
        with self._links_lock:
            if self._listener is None or self._listener.closed:  # no io thread any more
                link.close()
                return
            self._dropped.append(link)
        self._nudge.set()

    def _close_links(self) -> None:
        """The io thread has stopped: close every link and the listener."""
        if not hasattr(self, "_links"):  # the pool failed before it listened
            return
        with self._send_lock:
            for state in self._ranks.values():
                state.link = None
        with self._links_lock:
            if self._listener is not None:
                self._listener.close()
            for link in [link for _, link in self._links.values()] + self._dropped:
                link.close()
            self._links.clear()
            self._dropped.clear()

    def _handle(self, state: RankState, data: bytes | bytearray) -> None:
        raise NotImplementedError  # IoLoop's
