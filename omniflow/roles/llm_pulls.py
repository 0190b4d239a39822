"""The ``llm`` role's KV pulls and routing summary media (roles/llm.py): a fresh prompt
that opens with media another replica holds is first pulled from there when the cost model
says the transfer beats prefilling it (kv/pull_cost.py); anything that goes wrong with a
pull only means the prefix is computed here."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, cast

from omniflow.content import summary_key
from omniflow.engine import AsyncEngine, EmbeddingSpan, LLMEngine
from omniflow.engine.kv_transfer import EnginePrefixes, span_keys
from omniflow.kv.pull_cost import PullCost
from omniflow.roles.options import LLMOptions
from omniflow.runtime.kv_peers import KVPeers

log = logging.getLogger("omniflow.roles.llm")


class PrefixPulls:
    """Mixed into LLMRole: serving this replica's prefix pages and pulling others'."""

    uses_kv_peers = True

    options: LLMOptions
    engine: AsyncEngine
    llm: LLMEngine
    leading_media: OrderedDict[int, None]  # summary keys of media that began prompts, LRU
    summary_media: int

    async def use_kv_peers(self, peers: KVPeers) -> None:
        """Serve this engine's prefix pages to the other replicas and pull from them; the
        worker calls it after setup, before the replica registers."""
        if not self.options.kv_pull:
            return
        self.prefixes = EnginePrefixes(self.engine)
        self.pull_cost = PullCost(prefill=self.llm.prefill_rate)
        self.kv_endpoint = peers.serve(self.prefixes)
        self.kv_peers: KVPeers | None = peers
        self.pulls = {"pulled": 0, "recomputed": 0, "failed": 0}
        self._pulling: dict[int, asyncio.Future] = {}  # summary key -> its pull, running

    def _prefix_holder(self, spans: list[EmbeddingSpan]) -> tuple[int, Any] | None:
        """(summary key, record) of another replica holding the KV of the media that opens a
        fresh prompt, unseen here; None (at the cost of a dict lookup) when there is none."""
        peers = getattr(self, "kv_peers", None)
        if peers is None or not spans:
            return None
        if not _is_media(spans[0]):  # a resent spoken reply's speech: no media to pull
            return None
        kind, name = cast(tuple[str, str], spans[0].content_hash)  # as _turn makes them
        key = summary_key(kind, str(name))
        if key in self.leading_media and key not in self._pulling:
            return None
        holders = peers.holders(key)
        return (key, holders[0]) if holders else None

    async def _pull_prefix(
        self, request_id: str, key: int, holder: Any, prompt: list[int], spans: list
    ) -> None:
        """Pull the prompt's prefix pages from ``holder`` into the engine if that beats
        prefilling them; on any failure the prefill simply computes them. Requests for
        the same media while a pull runs wait for it rather than pull again."""
        running = self._pulling.get(key)
        if running is not None:
            await asyncio.shield(running)
            return
        done = self._pulling[key] = asyncio.get_running_loop().create_future()
        try:
            await self._pull(request_id, holder, prompt, spans)
        finally:
            del self._pulling[key]
            done.set_result(None)

    async def _pull(
        self, request_id: str, holder: Any, prompt: list[int], spans: list[EmbeddingSpan]
    ) -> None:
        tokens = prompt[:-1]  # admission leaves the last token to compute
        keys = span_keys(len(prompt), spans, len(tokens))
        importer = self.prefixes.importer(tokens, keys)
        peers = cast(KVPeers, self.kv_peers)
        try:
            held = await importer.begin()
            if (held + 1) * self.prefixes.page_size > len(tokens):
                return  # every whole page is here already
            result = await peers.pull(
                holder, request_id, tokens, keys, importer, held, self.pull_cost
            )
            if result.pulled_tokens:
                await importer.publish()
                self.pulls["pulled"] += 1
            else:
                self.pulls["recomputed"] += 1
        except Exception as e:  # noqa: BLE001 - a failed pull only means a local prefill
            self.pulls["failed"] += 1
            log.warning("request %s: KV pull from %s failed: %s", request_id, holder.actor_id, e)
        finally:
            await importer.abandon()

    def _note_leading_media(self, spans: list[EmbeddingSpan]) -> None:
        """Media at the start of a fresh prompt: its KV is a prefix others can reuse."""
        for span in spans:
            if not _is_media(span):
                continue
            kind, name = cast(tuple[str, str], span.content_hash)  # as _turn makes them
            key = summary_key(kind, str(name))
            self.leading_media[key] = None
            self.leading_media.move_to_end(key)
        while len(self.leading_media) > self.summary_media:
            self.leading_media.popitem(last=False)


def _is_media(span: EmbeddingSpan) -> bool:
    """A seen image's or sound's span, keyed (kind, content hash); a spoken reply's speech
    is keyed token by token (a list)."""
    return isinstance(span.content_hash, tuple)
