"""The JSON Schema of the IR's JSON export (``serialize.to_json``), derived from the msgspec
Structs of ``ir`` so that it cannot disagree with them.

``docs/ir-schema.json`` is this schema committed for readers and other tools (a test keeps it
equal to ``json_schema()``); ``docs/ir-schema.md`` describes the format in prose. Regenerate
the file after changing ``ir``::

    python -m walkserve.capture.schema > docs/ir-schema.json
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from walkserve.capture import ir


def json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a ``WalkGraph`` as ``serialize.to_json`` writes it."""
    return msgspec.json.schema(ir.WalkGraph)


def schema_text() -> str:
    """``json_schema()`` as the text committed in ``docs/ir-schema.json``."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(schema_text(), end="")
