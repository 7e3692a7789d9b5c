"""CURVE keys and the server-side guard of the conductor's TCP control sockets.

Owns key files, the ZAP authenticator of a ``WorkerPool``'s ZeroMQ context and the logging of
refused peers. What crosses its boundary: Z85 key strings (40 characters) in, files in a
keys directory, configured sockets out. Nothing here (or anywhere on the control path)
unpickles: messages are msgspec-encoded structs.

Keys directory (mode 0700; secrets 0600)::

    server.public  server.secret          the conductor's pair (generated at start-up)
    rank-R.public  rank-R.secret          the pair a remote worker of rank R presents

``ensure_keys(dir, ranks)`` creates what is missing and returns the ``KeySet``. The conductor
needs ``server.secret`` and every ``rank-R.public``; the remote worker of rank R needs
``server.public`` and its own pair (copy those three files to its host). Local (spawned)
workers get a pair made in memory at start-up.

``ControlGuard`` makes a pool's ROUTERs CURVE servers, runs a ZAP authenticator that admits
only the known client keys (a peer without CURVE, or with an unknown key, is refused: it
never gets a reply) and a monitor thread that logs every failed handshake as a warning on the
``walkserve.net`` logger, so refusals show up in the server's log. The server keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("walkserve.net")

_KEY_LEN = 40  # Z85 of 32 bytes
_DOMAIN = "walkserve"


@dataclass(frozen=True)
class KeyPair:
    public: str  # Z85, 40 characters
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("public", "secret"):
            value = getattr(self, name)
            if len(value) != _KEY_LEN:
                raise ValueError(
                    f"a CURVE {name} key is {_KEY_LEN} Z85 characters, got {len(value)}"
                )

    @staticmethod
    def generate() -> KeyPair:
        public, secret = zmq.curve_keypair()
        return KeyPair(public.decode("ascii"), secret.decode("ascii"))


@dataclass(frozen=True)
class KeySet:
    """The keys of one deployment: the server's pair and a public key per remote rank."""

    server: KeyPair
    clients: dict[int, str]  # rank -> public key


def ensure_keys(directory: str | os.PathLike[str], ranks: Iterable[int]) -> KeySet:
    """Create the server pair and a pair per rank in ``directory`` where missing (0700 / 0600);
    return them. Existing files are reused, so a deployer may make them once and copy them."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    server = _ensure_pair(root, "server")
    clients = {rank: _ensure_pair(root, f"rank-{rank}").public for rank in ranks}
    return KeySet(server, clients)


def load_worker_keys(
    directory: str | os.PathLike[str], rank: int, wait_s: float = 0.0
) -> tuple[str, KeyPair]:
    """(server public key, the pair of rank ``rank``), waiting up to ``wait_s`` for the files
    (a server started at the same time writes them)."""
    root = Path(directory)
    names = ("server.public", f"rank-{rank}.public", f"rank-{rank}.secret")
    deadline = time.monotonic() + wait_s
    while not all((root / n).exists() for n in names):
        if time.monotonic() >= deadline:
            missing = [n for n in names if not (root / n).exists()]
            raise ValueError(
                f"keys directory {root} lacks {missing}: copy server.public, rank-{rank}.public "
                f"and rank-{rank}.secret from the server's keys directory"
            )
        time.sleep(0.05)
    time.sleep(0.05)  # a writer finishing its files
    server = _read_key(root / "server.public")
    return server, KeyPair(_read_key(root / names[1]), _read_key(root / names[2]))


def _ensure_pair(root: Path, name: str) -> KeyPair:
    public, secret = root / f"{name}.public", root / f"{name}.secret"
    if public.exists() and secret.exists():
        return KeyPair(_read_key(public), _read_key(secret))
    pair = KeyPair.generate()
    _write(secret, pair.secret, 0o600)
    _write(public, pair.public, 0o644)
    return pair


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _read_key(path: Path) -> str:
    text = path.read_text().strip()
    if len(text) != _KEY_LEN:
        raise ValueError(f"{path} does not hold a Z85 CURVE key ({_KEY_LEN} characters)")
    return text


def secure_client(sock: zmq.Socket[bytes], server_public: str, pair: KeyPair) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_public`` (before connect)."""
    sock.curve_serverkey = server_public.encode("ascii")
    sock.curve_publickey = pair.public.encode("ascii")
    sock.curve_secretkey = pair.secret.encode("ascii")


# ----------------------------------------------------------------------------- guard

_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (a peer without CURVE keys?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol error)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused (unknown key)",
}


class ControlGuard:
    """CURVE servers, a ZAP authenticator and a refusal log for the sockets of one context.

    ``secure(sock)`` before ``bind``; ``start()`` after binding; ``close()`` before the context
    is terminated. ``refusals`` counts the failed handshakes seen (for tests and health)."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], server: KeyPair, clients: Iterable[str]
    ):
        self.server = server
        self._allowed = {c.encode("ascii") for c in clients}
        self._ctx = ctx
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("walkserve.net.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=_DOMAIN, credentials_provider=self)
        self._monitored: list[tuple[zmq.Socket[bytes], str]] = []
        self._monitors: list[zmq.Socket[bytes]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.refusals = 0

    def allow(self, public: str) -> None:
        self._allowed.add(public.encode("ascii"))

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: whether a client presenting Z85 public ``key`` may connect."""
        if key in self._allowed:
            return True
        log.warning("refused a control connection with an unknown CURVE key %s", key.decode())
        return False

    def secure(self, sock: zmq.Socket[bytes], endpoint_name: str) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.server.secret.encode("ascii")
        sock.zap_domain = _DOMAIN.encode()
        self._monitored.append((sock, endpoint_name))

    def start(self) -> None:
        events = 0
        for e in _FAILED:
            events |= e
        for sock, _ in self._monitored:
            self._monitors.append(sock.get_monitor_socket(events))
        self._thread = threading.Thread(target=self._watch, name="walkserve-net-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = zmq.Poller()
        names = {}
        for mon, (_, name) in zip(self._monitors, self._monitored):
            poller.register(mon, zmq.POLLIN)
            names[mon] = name
        while not self._stop.is_set():
            for mon, _ in poller.poll(100):
                with contextlib.suppress(zmq.ZMQError):
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                    what = _FAILED.get(event["event"])
                    if what is not None:
                        self.refusals += 1
                        log.warning(
                            "refused a control connection on %s (%s): %s; it gets no reply",
                            names[mon],
                            event["endpoint"].decode(errors="replace"),
                            what,
                        )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for (sock, _), mon in zip(self._monitored, self._monitors):
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            mon.close(linger=0)
        self._auth.stop()


__all__ = [
    "ControlGuard",
    "KeyPair",
    "KeySet",
    "ensure_keys",
    "load_worker_keys",
    "secure_client",
]
