"""``--max-queued``: how many HTTP requests are admitted at once. A request over the limit gets
503 with ``Retry-After``; an admitted one holds a ``Ticket`` until its response ends. So does
one that arrives while the server cannot serve it (``gate``: ``Server.unavailable``: a rank
restarting or failed, the server draining on SIGTERM or stopped)."""

from __future__ import annotations

from collections.abc import Callable

from walkserve.api.errors import ApiError


class Admission:
    """Counts admitted requests. Runs on the event loop only, so check-and-increment is
    atomic (no await in between)."""

    def __init__(
        self,
        limit: int | None,
        gate: Callable[[], str | None] = lambda: None,
        retry_after_s: int = 1,
    ) -> None:
        self.limit = limit
        self.active = 0
        self.gate = gate
        self.retry_after_s = retry_after_s

    def admit(self) -> Ticket:
        reason = self.gate()
        if reason is not None:
            raise ApiError(
                503,
                f"the server cannot take requests now: {reason}; retry later",
                "server_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if self.limit is not None and self.active >= self.limit:
            raise ApiError(
                503,
                f"the server is at its limit of {self.limit} queued requests; retry later",
                "server_busy",
            )
        self.active += 1
        return Ticket(self)


class Ticket:
    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.active -= 1
            self._admission = None
