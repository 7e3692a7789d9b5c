"""Where the server may read an ``image_url`` or ``video_url`` from besides a data URL: the
deployer's ``MediaFetch`` policy (vLLM's ``--allowed-local-media-path`` and
``--allowed-media-domains``).
Both are off by default: data URLs only.

    file:///abs/path or /abs/path   read only inside ``local_dir``: the path is resolved with
                                    realpath first, so ``..`` and symlinks cannot leave it
    http(s)://host/...              fetched only from a host in ``domains``, at most
                                    ``max_bytes``, within ``timeout_s`` (the
                                    body's reading included); a redirect is followed
                                    (at most ``MAX_REDIRECTS``) only to an allowed host

``check`` refuses a URL the policy does not allow (cheap: it runs while the prompt is rendered,
on the event loop); ``read`` reads it (blocking I/O: run it off the event loop). Both raise
``ApiError`` (a 400 naming ``where``). What crosses the boundary: URLs in, bytes out.
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.parse
from dataclasses import dataclass

from walkserve.api.errors import bad

MAX_REDIRECTS = 3
DEFAULT_MAX_BYTES = 16 << 20
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaFetch:
    local_dir: str | None = None  # the realpath of the directory files may be read from
    domains: frozenset[str] = frozenset()  # hosts (lower case) http(s) URLs may name
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.local_dir is not None and not os.path.isdir(self.local_dir):
            raise ValueError(f"--allowed-local-media-path {self.local_dir!r} is not a directory")
        if self.local_dir is not None:
            object.__setattr__(self, "local_dir", os.path.realpath(self.local_dir))
        object.__setattr__(self, "domains", frozenset(d.strip().lower() for d in self.domains))
        if any(not d or "/" in d for d in self.domains):
            raise ValueError(f"--allowed-media-domains: host names, got {sorted(self.domains)}")
        if self.max_bytes < 1:
            raise ValueError(f"--max-media-bytes must be >= 1, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"--media-fetch-timeout must be > 0, got {self.timeout_s}")

    def check(self, url: str, where: str, kind: str = "image") -> None:
        """A 400 unless the policy allows ``url`` (not a data URL) of a ``kind`` part."""
        scheme = _scheme(url)
        if scheme in ("http", "https"):
            if not self.domains:
                raise bad(
                    f"{where}: remote {kind} URLs are not enabled on this server; send the"
                    f" {kind} as a data URL (data:{kind}/...;base64,...)",
                    where,
                )
            self._host(url, where)
        elif scheme in ("file", ""):
            self._path(url, where, kind)
        else:
            raise bad(
                f"{where}: {kind} URLs other than data URLs ({scheme} scheme) are not enabled on"
                f" this server; send data:{kind}/...;base64,...",
                where,
            )

    def read(self, url: str, where: str) -> bytes:
        """The bytes ``url`` names (after ``check``)."""
        if _scheme(url) in ("http", "https"):
            return self._fetch(url, where)
        path = self._path(url, where)
        size = os.path.getsize(path)
        if size > self.max_bytes:
            raise bad(f"{where}: the file has {size} bytes; the limit is {self.max_bytes}", where)
        with open(path, "rb") as f:
            return f.read()

    def _path(self, url: str, where: str, kind: str = "image") -> str:
        if self.local_dir is None:
            raise bad(
                f"{where}: {kind} URLs other than data URLs (file paths) are not enabled on this"
                f" server; send data:{kind}/...;base64,...",
                where,
            )
        if _scheme(url) == "file":
            parts = urllib.parse.urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise bad(f"{where}: a file URL names no host (file:///path)", where)
            path = urllib.parse.unquote(parts.path)
        else:
            path = url
        if not os.path.isabs(path):
            raise bad(f"{where}: a local path must be absolute", where)
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.local_dir]) != self.local_dir:
            raise bad(f"{where}: the path is outside the directory this server reads", where)
        if not os.path.isfile(real):
            raise bad(f"{where}: no such file in the directory this server reads", where)
        return real

    def _host(self, url: str, where: str) -> str:
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in self.domains:
            raise bad(
                f"{where}: host {host!r} is not in this server's allowed media domains", where
            )
        return host

    def _fetch(self, url: str, where: str) -> bytes:
        import httpx

        deadline = time.monotonic() + self.timeout_s  # httpx's timeout is per read
        with httpx.Client(timeout=self.timeout_s, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                self._host(url, where)
                try:
                    with client.stream("GET", url) as response:
                        if response.is_redirect:
                            url = urllib.parse.urljoin(url, response.headers.get("location", ""))
                            continue
                        if response.status_code != 200:
                            raise bad(f"{where}: the URL answered {response.status_code}", where)
                        return self._body(response, where, deadline)
                except httpx.HTTPError as e:
                    raise bad(f"{where}: the URL could not be fetched ({e})", where) from None
        raise bad(f"{where}: more than {MAX_REDIRECTS} redirects", where)

    def _body(self, response: object, where: str, deadline: float) -> bytes:
        import httpx

        assert isinstance(response, httpx.Response)
        data = bytearray()
        for chunk in response.iter_bytes():
            data += chunk
            if time.monotonic() > deadline:
                raise bad(f"{where}: the fetch took longer than {self.timeout_s} s", where)
            if len(data) > self.max_bytes:
                raise bad(
                    f"{where}: the body is larger than the limit of {self.max_bytes} bytes", where
                )
        return bytes(data)


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url and not url.startswith("/") else ""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The serve command's media flags."""
    parser.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="image_url / video_url may name files (file:// or absolute paths) inside DIR; off"
        " by default",
    )
    parser.add_argument(
        "--allowed-media-domains",
        metavar="HOSTS",
        help="image_url / video_url may be an http(s) URL of these comma-separated hosts; off"
        " by default",
    )
    parser.add_argument(
        "--max-media-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        metavar="N",
        help="a fetched or read image or video at most N bytes",
    )
    parser.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="seconds an image or video URL fetch may take",
    )


def from_args(args: argparse.Namespace) -> MediaFetch:
    hosts = args.allowed_media_domains
    return MediaFetch(
        local_dir=args.allowed_local_media_path,
        domains=frozenset(h for h in hosts.split(",") if h.strip()) if hosts else frozenset(),
        max_bytes=args.max_media_bytes,
        timeout_s=args.media_fetch_timeout,
    )
