"""``python -m benchmarks ...``: the HTTP load generator (``benchmarks/loadgen.py``)."""

from __future__ import annotations

from benchmarks.loadgen import main

if __name__ == "__main__":
    raise SystemExit(main())
