"""One-time tokens over pinned KV pages: the holder's book of prepared pulls.

A prepare pins a prefix's pages and ``grant`` records them under a fresh random token; the
fetch (or drop) that presents it ``take``s the grant out of the book, once. A grant nobody
takes before its deadline comes back from ``expired``. Either way the caller unpins the
pages: the book only says whose they are and until when, it never frees anything itself.
Tokens used or expired are remembered (a bounded number) so a second use is told why.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

USED, EXPIRED, UNKNOWN = "token_used", "token_expired", "token_unknown"


class PullRefused(ValueError):
    """A token that does not open a grant; ``code`` is USED, EXPIRED or UNKNOWN."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Grant(NamedTuple):
    token: str
    pages: list[int]  # pinned device pages of the prefix, in order
    num_tokens: int
    deadline: float  # on the book's clock


class PullTokens:
    def __init__(
        self,
        ttl_s: float = 10.0,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"PullTokens: ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._open: dict[str, Grant] = {}
        self._spent: OrderedDict[str, str] = OrderedDict()  # token -> USED or EXPIRED
        self._remember = remember

    def __len__(self) -> int:
        return len(self._open)

    def grant(self, pages: list[int], num_tokens: int) -> Grant:
        grant = Grant(secrets.token_hex(16), list(pages), num_tokens, self._clock() + self.ttl_s)
        self._open[grant.token] = grant
        return grant

    def take(self, token: str) -> Grant:
        """The grant ``token`` opens, out of the book; ``PullRefused`` saying why not."""
        grant = self._open.get(token)
        if grant is not None and grant.deadline <= self._clock():
            self.expired()  # past its deadline: expired, even if nobody swept it yet
            grant = None
        if grant is None:
            why = self._spent.get(token, UNKNOWN)
            said = {
                USED: "was already used (a token is good for one fetch)",
                EXPIRED: f"expired (tokens live {self.ttl_s:g} s)",
                UNKNOWN: "is not one this replica gave out",
            }[why]
            raise PullRefused(why, f"KV pull token {token[:8]}… {said}")
        del self._open[token]
        self._spend(token, USED)
        return grant

    def expired(self) -> list[Grant]:
        """Grants past their deadline, out of the book (their pages are the caller's to unpin)."""
        now = self._clock()
        gone = [g for g in self._open.values() if g.deadline <= now]
        for grant in gone:
            del self._open[grant.token]
            self._spend(grant.token, EXPIRED)
        return gone

    def drain(self) -> list[Grant]:
        """Every open grant (the holder is closing)."""
        gone, self._open = list(self._open.values()), {}
        return gone

    def _spend(self, token: str, why: str) -> None:
        self._spent[token] = why
        while len(self._spent) > self._remember:
            self._spent.popitem(last=False)
