"""``multipart/form-data`` bodies (RFC 7578) for the upload routes, parsed with the standard
library's ``email`` parser, so no multipart package is needed. What crosses the boundary: the
raw body and its ``Content-Type`` in, a ``Form`` of text fields and file parts out; anything
malformed raises ``ValueError`` with a message for the client."""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FilePart:
    filename: str | None
    content_type: str
    data: bytes


@dataclass(frozen=True)
class Form:
    fields: dict[str, str] = field(default_factory=dict)  # text parts (no filename)
    files: dict[str, FilePart] = field(default_factory=dict)  # parts with a filename


def parse_form(body: bytes, content_type: str) -> Form:
    """The parts of a ``multipart/form-data`` body; a repeated name keeps its last part."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ValueError(
            f"the request must be multipart/form-data, got {content_type or 'no Content-Type'!r}"
        )
    if "boundary=" not in content_type:
        raise ValueError("the multipart/form-data Content-Type has no boundary")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart() or message.defects:
        raise ValueError("the multipart/form-data body is malformed")
    fields: dict[str, str] = {}
    files: dict[str, FilePart] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise ValueError("a multipart part has no name in its Content-Disposition")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        filename = part.get_filename()
        if filename is None:
            try:
                fields[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"form field {name!r} is not UTF-8 text") from None
        else:
            files[name] = FilePart(filename, part.get_content_type(), data)
    return Form(fields, files)
