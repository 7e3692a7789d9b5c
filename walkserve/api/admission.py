"""``--max-queued``: how many requests are admitted at once, counted by what they run (a
completion with ``n`` choices counts ``n``, a walk request its rows: ``runtime.limits.fan_out``). A request over the limit gets 503 with
``Retry-After``; an admitted one holds a ``Ticket`` until its response ends. So does
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

    def admit(self, weight: int = 1, param: str = "n") -> Ticket:
        """Admit a request that runs ``weight`` requests on the server (a completion's ``n``
        choices: each is a walk of its own; a walk's rows), or raise: 503 when the server is
        unavailable or full, 400 naming ``param`` when ``weight`` alone is over the limit (it
        could never be admitted)."""
        reason = self.gate()
        if reason is not None:
            raise ApiError(
                503,
                f"the server cannot take requests now: {reason}; retry later",
                "server_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if self.limit is not None and weight > self.limit:
            what = f"n={weight} choices" if param == "n" else f"{param}: {weight} rows"
            raise ApiError(
                400,
                f"{what} are more than this server runs at once "
                f"(--max-queued {self.limit}); ask for at most {self.limit}",
                param=param,
            )
        if self.limit is not None and self.active + weight > self.limit:
            raise ApiError(
                503,
                f"the server is at its limit of {self.limit} queued requests; retry later",
                "server_busy",
            )
        self.active += weight
        return Ticket(self, weight)


class Ticket:
    def __init__(self, admission: Admission, weight: int = 1) -> None:
        self._admission: Admission | None = admission
        self.weight = weight

    def release(self) -> None:
        if self._admission is not None:
            self._admission.active -= self.weight
            self._admission = None
