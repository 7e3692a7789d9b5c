"""``api.mediafetch``: image URLs besides data URLs, only as the deployer allows. Files inside
``--allowed-local-media-path`` are read, others (outside, a ``..`` or symlink escape) are 400s;
http URLs served here by ``http.server`` on 127.0.0.1 are fetched from allowed hosts only,
with a byte limit and no redirect to another host; the chat parts read them."""

from __future__ import annotations

import argparse
import http.server
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from walkserve.api import chatmedia, chatprompt, mediafetch
from walkserve.api.errors import ApiError
from walkserve.api.mediafetch import MediaFetch
from walkserve.api.profile import ChatMediaTask, MediaWalk, TextTask, plain_chat
from walkserve.api.schemas import ChatMessage

W = "messages[0].content[0].image_url.url"


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(ids).decode()


def png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (3, 2), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture()
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """(the allowed directory holding a.png, a file outside it)."""
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png())
    outside = tmp_path / "secret.png"
    outside.write_bytes(png())
    (allowed / "link.png").symlink_to(outside)
    return allowed, outside


def test_files_inside_the_directory_are_read_and_nothing_else(tree: tuple[Path, Path]) -> None:
    allowed, outside = tree
    fetch = MediaFetch(local_dir=str(allowed))
    for url in (str(allowed / "a.png"), f"file://{allowed / 'a.png'}", f"file://{allowed}/./a.png"):
        fetch.check(url, W)
        assert fetch.read(url, W) == png()
    escapes = [
        (str(outside), "outside the directory"),
        (f"{allowed}/../secret.png", "outside the directory"),
        (f"file://{allowed}/%2E%2E/secret.png", "outside the directory"),
        (str(allowed / "link.png"), "outside the directory"),  # a symlink out
        (str(allowed / "none.png"), "no such file"),
        ("a.png", "must be absolute"),
        ("file://host/a.png", "names no host"),
    ]
    for url, match in escapes:
        with pytest.raises(ApiError, match=match) as info:
            fetch.check(url, W)
        assert info.value.param == W
    with pytest.raises(ApiError, match="file paths"):
        MediaFetch().check(str(allowed / "a.png"), W)  # off by default
    small = MediaFetch(local_dir=str(allowed), max_bytes=10)
    with pytest.raises(ApiError, match="the limit is 10"):
        small.read(str(allowed / "a.png"), W)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/redirect"):
            port = self.server.server_address[1]
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/a.png")
            self.end_headers()
            return
        if self.path == "/same":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        if self.path == "/slow":  # a body that drips in
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"x" * 100)
                self.wfile.flush()
                time.sleep(0.15)
            return
        body = png() if self.path == "/a.png" else b"x" * 100_000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_urls_are_fetched_from_allowed_hosts_only(origin: str) -> None:
    fetch = MediaFetch(domains=frozenset({"127.0.0.1"}), max_bytes=50_000, timeout_s=5)
    fetch.check(f"{origin}/a.png", W)
    assert fetch.read(f"{origin}/a.png", W) == png()
    assert fetch.read(f"{origin}/same", W) == png()  # a redirect on the same host
    with pytest.raises(ApiError, match="larger than the limit of 50000 bytes") as info:
        fetch.read(f"{origin}/big", W)
    assert info.value.param == W
    with pytest.raises(ApiError, match="'localhost' is not in"):
        fetch.read(f"{origin}/redirect", W)  # to another host
    hasty = MediaFetch(domains=frozenset({"127.0.0.1"}), timeout_s=0.5)
    with pytest.raises(ApiError, match=r"took longer than 0\.5 s"):
        hasty.read(f"{origin}/slow", W)
    other = MediaFetch(domains=frozenset({"example.com"}))
    with pytest.raises(ApiError, match=r"'127\.0\.0\.1' is not in this server's allowed"):
        other.check(f"{origin}/a.png", W)
    with pytest.raises(ApiError, match="remote image URLs are not enabled"):
        MediaFetch().check(f"{origin}/a.png", W)
    with pytest.raises(ApiError, match="ftp scheme"):
        fetch.check("ftp://127.0.0.1/a.png", W)


def test_chat_parts_read_allowed_urls(tree: tuple[Path, Path], origin: str) -> None:
    seen: list[tuple[int, ...]] = []

    def inputs(images: list[Any]) -> tuple[dict[str, Any], list[list[int]]]:
        seen.extend(tuple(image.shape) for image in images)
        return {}, [[7] for _ in images]

    task = ChatMediaTask(image=MediaWalk("image", inputs), max_parts=2)
    text = TextTask(
        "chat", "ids", "n", "tokens", None, None, 999, 99, 8, 4, encode, decode, plain_chat
    )
    fetch = MediaFetch(local_dir=str(tree[0]), domains=frozenset({"127.0.0.1"}))
    content = [{"type": "image_url", "image_url": {"url": str(tree[0] / "a.png")}}]
    content.append({"type": "image_url", "image_url": {"url": f"{origin}/a.png"}})
    msgs = [ChatMessage.model_validate({"role": "user", "content": content})]
    parts = chatmedia.MediaParts(task, "m", 1 << 20, fetch=fetch)
    rendered = chatprompt.render(text, msgs, None, "m", parts.mark)
    walk, _, ids = parts.prompt(rendered, text.encode)
    assert walk == "image" and seen == [(2, 3, 3), (2, 3, 3)] and ids.count(7) == 2


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    mediafetch.add_flags(parser)
    off = mediafetch.from_args(parser.parse_args([]))
    assert off == MediaFetch()
    args = parser.parse_args(
        ["--allowed-local-media-path", os.getcwd(), "--allowed-media-domains", "A.example, b"]
    )
    on = mediafetch.from_args(args)
    assert on.domains == {"a.example", "b"} and on.local_dir == os.path.realpath(os.getcwd())
    with pytest.raises(ValueError, match="is not a directory"):
        MediaFetch(local_dir="/no/such/dir")
