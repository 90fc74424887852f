"""The front end's router over data-parallel schedulers (DP attention ranks, AFD attention workers):
``--load-balance-method`` (SGLang's flag).

* ``shortest_queue``: the scheduler with the fewest unfinished requests routed to it (counted here exactly: +1 when a
  request is sent, -1 when the front end is done with it, finished, aborted or disconnected); ties go in turn
  (round robin from the scheduler after the last one picked), so requests sent one after another alternate as with
  ``round_robin``. SGLang's data-parallel controller balances on the schedulers' reported queue lengths; counting
  at the front end needs no report and never lags.
* ``round_robin``: in turn.

A request's aborts go to the scheduler that holds it (:meth:`DpRouter.owner`).
"""

from __future__ import annotations

from typing import Optional

LOAD_BALANCE_METHODS = ("shortest_queue", "round_robin")


class DpRouter:
    """Picks a scheduler per request (see the module docstring). Not thread-safe: the TokenizerManager calls it from
    its event loop only.

    Args:
        num_ranks: the data-parallel schedulers (>= 1).
        method: one of :data:`LOAD_BALANCE_METHODS`.
    Raises:
        ValueError: ``num_ranks < 1`` or an unknown method (naming the flag).
    """

    def __init__(self, num_ranks: int, method: str = "shortest_queue"):
        if num_ranks < 1:
            raise ValueError(f"DpRouter: num_ranks={num_ranks} must be >= 1")
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method={method!r} is invalid: use {' or '.join(LOAD_BALANCE_METHODS)}")
        self.num_ranks, self.method = num_ranks, method
        self._load = [0] * num_ranks
        self._owner: dict[str, int] = {}
        self._next = 0

    @property
    def loads(self) -> list[int]:
        """Unfinished requests per scheduler."""
        return list(self._load)

    def pick(self, rid: str) -> int:
        """The scheduler for new request ``rid`` (recorded as its owner and counted in its load). A rid that is
        already placed keeps its scheduler (no double count)."""
        if rid in self._owner:
            return self._owner[rid]
        n = self.num_ranks
        order = [(self._next + i) % n for i in range(n)]
        rank = min(order, key=lambda r: self._load[r]) if self.method == "shortest_queue" else order[0]
        self._next = (rank + 1) % n
        self._owner[rid] = rank
        self._load[rank] += 1
        return rank

    def owner(self, rid: str) -> Optional[int]:
        """The scheduler holding ``rid``, or None when it is not (or no longer) placed."""
        return self._owner.get(rid)

    def release(self, rid: str) -> None:
        """The front end is done with ``rid`` (finished, aborted or its client left): it no longer counts."""
        rank = self._owner.pop(rid, None)
        if rank is not None:
            self._load[rank] -= 1
