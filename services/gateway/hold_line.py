"""Requests held for capacity wait in a line (one per length class, placement.py), and
only its head re-plans.

The router holds a request (``Hold``) when its TTFT is still reachable but no worker
pair has room now. Held requests used to re-plan each on its own every poll: a held
crowd then cost one router decision per request per poll, and under overload that is
what took the gateway's CPU (a 2 prefill + 2 decode tiny cluster offered 96 req/s made
about 40 decisions per request, and goodput fell to a third of its peak). In the line:

* the head re-plans every poll until it is placed, refused or out of time, then
  leaves and the next request becomes the head;
* the others sleep until they are the head (or their time is up): one decision per
  poll, however many wait;
* a request that arrives while others wait joins the back, unless the line drains
  too slowly for it: with ``k`` ahead and the line's recent departure rate ``μ``
  (placed or refused, over ``window_s``), it would wait about ``k / μ``, and at least
  as long as the head has waited so far (its sojourn, the line's delay as it is now,
  which also covers a line that has not moved lately); past its remaining budget it
  is refused at once rather than after waiting its time out.

Arrival order is kept: a request never takes the room the head is waiting for.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["HoldLine"]


class HoldLine:
    def __init__(self, window_s: float = 2.0, min_departures: int = 2) -> None:
        self.window_s = window_s
        self.min_departures = min_departures  # fewer in the window: no estimate yet
        self._line: dict[str, asyncio.Event] = {}  # arrival order: the head first
        self._head_since_s = 0.0  # when the present head became the head
        self._departures: deque[float] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def expected_wait_s(self, now_s: float) -> float | None:
        """How long a request joining now would wait to reach the head; None while the
        line is empty."""
        if not self._line:
            return None
        self._trim(now_s)
        head_s = max(0.0, now_s - self._head_since_s)
        if len(self._departures) < self.min_departures:
            return head_s
        rate_per_s = len(self._departures) / self.window_s
        return max(head_s, len(self._line) / rate_per_s)

    def join(self, request_id: str, now_s: float) -> None:
        turn = asyncio.Event()
        if not self._line:
            turn.set()
            self._head_since_s = now_s
        self._line[request_id] = turn

    async def wait_turn(self, request_id: str, timeout_s: float) -> bool:
        """True when ``request_id`` is the head, False if ``timeout_s`` passed first."""
        turn = self._line[request_id]
        if turn.is_set():
            return True
        try:
            await asyncio.wait_for(turn.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    def leave(self, request_id: str, now_s: float) -> None:
        """``request_id`` was placed, refused or gave up: the next one is the head."""
        turn = self._line.pop(request_id, None)
        if turn is None:
            return
        self._departures.append(now_s)
        self._trim(now_s)
        if turn.is_set() and self._line:
            next(iter(self._line.values())).set()
            self._head_since_s = now_s

    def _trim(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._departures and self._departures[0] < horizon:
            self._departures.popleft()
