"""A rank link: the messages between the conductor and one rank it spawned on this host, over
one Unix stream socket, in place of the ZeroMQ pair of sockets a remote rank uses (and between
two such ranks, a consumer's pulls of the values another holds: ``peers``)::

    listener = LinkListener(path)             # the server: in its private (0700) directory
    link, pid = listener.accept()             # the io thread, once the fd is readable: and
                                              # which process it is (the kernel's SO_PEERCRED)

    link = Link.connect(path)                 # the worker, before its Join
    link.send(data)                           # any thread: False when some of it waits;
                                              # LinkFull past its bound of unsent bytes
    link.flush()                              # the socket is writable: what waits, True once out
    link.send_all(data, timeout_s)            # block until it is out (a worker's reports)
    for data in link.recv(): ...              # every whole message readable now
    link.fileno(), link.waiting(), link.closed
    link.ring(bell); link.watch(bell)         # a doorbell (``doorbell``): the conductor rings
                                              # it after each write, the rank's ``waiting()``
                                              # reads it instead of polling the socket

Why: a ZeroMQ message passes each side's ZeroMQ I/O thread, and on a small host each of them
wakes from sleep: a region start and its exit cost two such crossings more than a plain
socket's (README, the execution model). The framing that ZeroMQ gave is a length before each
message (``<Q``), and its queueing a deque of what the socket did not take yet: ``send`` never
blocks (the conductor's io thread writes the rest when the socket is writable, so it never
waits on a rank that waits on it), ``send_all`` blocks (a worker's engine thread waits for its
conductor as ZeroMQ's full queue made it wait). A message is read into its own buffer once it
is larger than a read's scratch, not copied again. Nothing here decodes a message; pickle is
never involved. ``LinkClosed``: the other side is gone. ``LinkFull``: the other side reads
nothing and what waits for it reached the link's bound (``max_unsent``), as ZeroMQ's full
queue refused a message: a rank that stops reading cannot grow the conductor's memory.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import select
import socket
import struct
import threading
import time

from walkserve.runtime.doorbell import Doorbell

__all__ = ["Link", "LinkClosed", "LinkFull", "LinkListener", "available"]

_LENGTH = struct.Struct("<Q")
SCRATCH = 64 * 1024  # a read's size: smaller messages are cut from it, larger get their own
BUFFER_BYTES = 4 << 20  # asked of the kernel (capped at its wmem_max): an exit in one write
MAX_MESSAGE_BYTES = 1 << 36  # a longer length is not one of ours: the link is broken


class LinkClosed(ConnectionError):
    """The other side closed the link (its process ended), or its bytes make no sense."""


class LinkFull(BufferError):
    """A message refused: the bytes waiting for the other side to read reached the bound."""


def available() -> bool:
    """Whether this host can run rank links: Unix sockets and the peer's credentials."""
    return hasattr(socket, "AF_UNIX") and hasattr(socket, "SO_PEERCRED")


class Link:
    """One side of a rank link (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        buffer_bytes: int | None = BUFFER_BYTES,
        max_unsent: int | None = None,
    ) -> None:
        """``buffer_bytes``: the socket's buffers (None: the kernel's default). A sender whose
        message fits returns at once instead of waiting for the reader to drain it: a worker's
        490 KB exit of 16 rollouts left in ~90 us, against ~270-360 us with the 208 KB default."""
        sock.setblocking(False)
        self.max_unsent = max_unsent  # bytes ``send`` may leave waiting (None: no bound)
        if buffer_bytes is not None:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)
        self._sock = sock
        self._fd = sock.fileno()
        self._lock = threading.Lock()  # senders: ``send``, ``flush``, ``send_all``
        self._out: collections.deque[memoryview] = collections.deque()  # not yet written
        self._unsent = 0  # bytes in ``_out``
        self._buf = b""  # bytes read past the last whole message (less than a header + body)
        self._body: bytearray | None = None  # a large message being read into its own buffer
        self._got = 0  # of ``_body``
        self._poll = select.poll()  # ``waiting``: readable now?
        self._poll.register(self._fd, select.POLLIN)
        self.closed = False
        # the conductor's side: rung after each write (``ring``); the rank's: what ``waiting``
        # reads instead of a poll once the rank found it (``watch``). See ``doorbell``.
        self._bell: Doorbell | None = None
        self._watched: Doorbell | None = None

    @classmethod
    def connect(cls, path: str, timeout_s: float = 10.0) -> Link:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        return cls(sock)

    def fileno(self) -> int:
        return self._fd

    def ring(self, bell: Doorbell | None) -> None:
        """Ring ``bell`` after each write from now on (the conductor's side)."""
        with self._lock:
            self._bell = bell

    def watch(self, bell: Doorbell) -> None:
        """Ask ``bell`` whether bytes came (``waiting()``) instead of polling the socket: its
        other side rings it after each write (the rank's side). Until the next ``recv``, it
        says that bytes came if it was ever rung: what came before it was watched is read."""
        self._watched = bell

    # ------------------------------------------------------------------ sending

    def send(self, data: bytes) -> bool:
        """Queue ``data`` as one message and write what the socket takes now (any thread;
        never blocks): True when all of it left, False when some waits for ``flush``. Raises
        ``LinkClosed`` when the other side is gone, ``LinkFull`` (nothing queued) when what
        already waits and ``data`` together pass ``max_unsent`` (a message alone may be
        larger: it goes when nothing waits)."""
        head = _LENGTH.pack(len(data))
        size = len(head) + len(data)
        with self._lock:
            if self.closed:
                raise LinkClosed("the link is closed")
            if self._out:  # behind what waits already: in order
                if self.max_unsent is not None and self._unsent + size > self.max_unsent:
                    raise LinkFull(
                        f"{self._unsent} bytes wait for the other side to read them (bound"
                        f" {self.max_unsent}): a message of {len(data)} bytes refused"
                    )
                self._out.append(memoryview(head))
                if data:  # an empty view would never be written: ``flush`` would spin on it
                    self._out.append(memoryview(data))
                self._unsent += size
                return False
            try:
                sent = self._sock.sendmsg((head, data))
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._broken(e)
            if sent and self._bell is not None:
                self._bell.ring()
            if sent == size:
                return True
            if sent < len(head):
                self._out.append(memoryview(head)[sent:])
                if data:
                    self._out.append(memoryview(data))
            else:
                self._out.append(memoryview(data)[sent - len(head) :])
            self._unsent = size - sent
            return False

    def flush(self) -> bool:
        """Write what waits, as far as the socket takes it (the socket is writable): True once
        nothing waits. Raises ``LinkClosed`` when the other side is gone."""
        with self._lock:
            out = self._out
            while out:
                try:
                    sent = self._sock.sendmsg(list(out)[:64])
                except BlockingIOError:
                    return False
                except OSError as e:
                    self._broken(e)
                if sent and self._bell is not None:
                    self._bell.ring()
                self._unsent -= sent
                while sent and out:
                    first = out[0]
                    if sent >= len(first):
                        sent -= len(first)
                        out.popleft()
                    else:
                        out[0] = first[sent:]
                        sent = 0
            return True

    def pending(self) -> bool:
        """Whether some sent message waits for ``flush``."""
        return bool(self._out)

    def unsent(self) -> int:
        """Bytes of sent messages that wait for ``flush``."""
        return self._unsent

    def send_all(self, data: bytes, timeout_s: float) -> None:
        """``send``, then wait until all of it left (a worker's reports: its conductor reads
        them, so this ends unless the conductor is stuck). Raises ``TimeoutError`` after
        ``timeout_s`` (what is left stays queued, to go first next time), ``LinkClosed`` when
        the other side is gone."""
        if self.send(data):
            return
        deadline = time.monotonic() + timeout_s
        writable = select.poll()
        writable.register(self._fd, select.POLLOUT)
        while not self.flush():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the link took no bytes for {timeout_s:.0f} s")
            writable.poll(min(remaining, 1.0) * 1000)

    # ------------------------------------------------------------------ receiving

    def waiting(self, timeout_ms: int = 0) -> bool:
        """Whether bytes wait to be read, after waiting up to ``timeout_ms`` for some (0:
        cheap, one poll of the fd); some may be the start of a message only, which ``recv``
        keeps for the next read. Where a doorbell is watched, ``waiting()`` reads it."""
        if not timeout_ms and self._watched is not None:
            return self._watched.rung()
        return bool(self._poll.poll(timeout_ms))

    def recv(self) -> list[bytes | bytearray]:
        """Every whole message readable now, in order (none: nothing whole yet). Sets
        ``closed`` when the other side closed it (what came before is returned first)."""
        out: list[bytes | bytearray] = []
        sock = self._sock
        if self._watched is not None:
            self._watched.seen()  # before reading: a write it misses has rung since
        while not self.closed:
            body = self._body
            if body is not None:  # a large message: straight into its own buffer
                try:
                    n = sock.recv_into(memoryview(body)[self._got :])
                except BlockingIOError:
                    break
                except OSError:
                    n = 0
                if n == 0:
                    self.closed = True
                    break
                self._got += n
                if self._got == len(body):
                    out.append(body)
                    self._body = None
                continue
            try:
                chunk = sock.recv(SCRATCH)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            if not self._cut(self._buf + chunk if self._buf else chunk, out):
                break
            if len(chunk) < SCRATCH and self._body is None:
                break  # the socket is most likely empty: a poll says when it is not
        return out

    def _cut(self, buf: bytes, out: list[bytes | bytearray]) -> bool:
        """Append ``buf``'s whole messages to ``out``; keep the rest (a message larger than
        ``SCRATCH`` goes on in ``_body``). False when its bytes are not a length."""
        pos, end = 0, len(buf)
        while end - pos >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(buf, pos)
            if n > MAX_MESSAGE_BYTES:
                self.closed = True
                return False
            start = pos + _LENGTH.size
            if end - start >= n:
                out.append(buf[start : start + n])
                pos = start + n
                continue
            if n > SCRATCH:  # read the rest of it in place
                body = self._body = bytearray(n)
                body[: end - start] = buf[start:end]
                self._got = end - start
                pos = end
            break
        self._buf = buf[pos:] if pos < end else b""
        return True

    # ------------------------------------------------------------------ the end

    def _broken(self, e: OSError) -> None:
        self.closed = True
        raise LinkClosed(f"the link is closed ({os.strerror(e.errno or errno.EPIPE)})") from e

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        for bell in (self._bell, self._watched):
            if bell is not None:
                bell.close()


class LinkListener:
    """Where the ranks this process spawns connect their links (a Unix socket in the
    conductor's private directory); which rank a link is, is its process's pid, as the kernel
    reports the peer (a process cannot claim another's)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(path)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._fd = self._sock.fileno()
        self.closed = False

    def fileno(self) -> int:
        return self._fd

    def accept(self, max_unsent: int | None = None) -> tuple[Link, int] | None:
        """The next connection (a ``Link`` bounded by ``max_unsent``) and its process's pid
        (-1 where the host names none; None: no connection waits)."""
        try:
            sock, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        pid = -1  # unknown: no peer credentials on this host (the pool needs them: ``available``)
        if hasattr(socket, "SO_PEERCRED"):
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():  # the directory is ours alone; still, never another user's
                sock.close()
                return None
        return Link(sock, max_unsent=max_unsent), pid

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
