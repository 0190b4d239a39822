"""``llm`` role: the LongCat-style omni LLM — text in/out, image and audio tokens out.

Input (joined from the client and the encoders):
    data["messages"]: [{role, content}]    the dialogue, rendered by the chat template
                                           (llm_prompt.py); or data["text"]: one user turn;
                                           or data["prompt"]: raw text, no template
    tensors["image_embeds"] [N, hidden], data["image_hash"]    from vision_encoder (optional)
    tensors["audio_embeds"] [M, hidden], data["audio_hash"]    from audio_encoder (optional)
    params: want ("text,image,audio"), max_tokens, temperature, top_p, top_k, seed,
            image_grid [h, w], cfg_scale, audio_chunks, audio_chunk_tokens,
            audio_first_chunk_tokens (the first chunk sooner; default 1)
    session (the request's): continue that dialogue; its tokens are the prompt's prefix
Output (streamed):
    {"text": str}                          text deltas (to the client); the last has
                                           "finish_reason" (stop/length), and each has
                                           "logprobs" when params.logprobs is set
    {"image_codes": int64 [h*w, 8], "image_grid": [h, w]}   (routes to image_decoder)
    {"audio_codes": int64 [n, 8], "index": i}               chunks (stream to audio_decoder)

Everything runs through the paged engine (continuous batching, prefix cache keyed by the
media's content hashes, so a later turn reuses every earlier turn's KV, generated media
included). Image and audio tokens are decoded the LongCat way: the LLM's hidden state
feeds a depth head that predicts the 8 codebook ids of one token, whose embedding is the
next input; each is one engine decode step (a codes head, engine/heads.py). Image tokens
use classifier-free guidance against a paired unconditional sequence (the prompt without
the user's turns), scheduled with it. A turn is one sequence: text, then image, then
audio each go on from the last stage's KV. Random weights cannot choose a modality, so
``want`` forces which outputs are made.

Options: ``LLMOptions`` in roles/options.py. ``hidden_size`` of a build_tiny model must
match the encoders'. ``host_kv_mb``: KV pages evicted from the device go to this much of
the deployment's host pool (0: dropped), ``ssd_kv_mb``: and below that to this much of
``[cache] ssd_dir``; ``share_kv``: K/V tensors in the host pool, so the engine can lend a
request's KV read-only to another process.

KV pulls (``kv_pull``, on by default): the replica serves its prefix cache's pages to the
other replicas of the role (runtime/kv_peers.py). A fresh prompt that opens with media
another replica's routing summary names, and that this one has not seen, is first pulled
from there when the cost model says the transfer beats prefilling it (kv/pull_cost.py);
anything that goes wrong with a pull only means the prefix is computed here.

Routing summary: ``meta()`` publishes (in the replica's registry record) the
``summary_key`` of every session this replica holds and of the media that began the
prompts it served recently, so ``prefix_aware`` producers send a session's next turn
here, and a request opening with the same image to where its KV is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from omniflow.content import SUMMARY_META, summary_key
from omniflow.engine import (
    AsyncEngine,
    EmbeddingSpan,
    EngineConfig,
    Guidance,
    LLMEngine,
    SamplingParams,
)
from omniflow.engine.figures import engine_description, engine_figures
from omniflow.engine.heads import codes_key
from omniflow.engine.kv_transfer import EnginePrefixes, span_keys
from omniflow.kv.pull_cost import PullCost
from omniflow.models.loader import load_tokenizer
from omniflow.models.omni import load_depth_head
from omniflow.models.omni.checkpoint import CheckpointError, is_next_folder
from omniflow.models.omni.loader import ensure_model, has_model, load_model
from omniflow.models.omni.next_builder import ensure_next
from omniflow.models.omni.next_media import load_next_media_heads
from omniflow.models.tiny.builder import build_tiny_model
from omniflow.roles.base import ModelActor
from omniflow.roles.chat_template import ChatTemplate, TemplateError, load_chat_template
from omniflow.roles.llm_prompt import (
    Media,
    PromptBuilder,
    StopText,
    media_inputs,
    request_messages,
    token_logprobs,
)
from omniflow.roles.options import LLMOptions, LLMParams, read_params
from omniflow.roles.tiny_build import build_atomically
from omniflow.runtime.actor import RESUMABLE_META, BadRequest, Context, Request
from omniflow.runtime.kv_peers import KV_PULL_META, KVPeers
from omniflow.runtime.priority import lower_thread_priority

log = logging.getLogger(__name__)
AUDIO_CODEBOOKS = [8192, 4096, 2048] + [1024] * 5
IMAGE_CODEBOOKS = [1024] * 8
_SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "logprobs",
)


class MediaHead:
    """The engine's codes head (engine/heads.py) for one LongCat modality: the depth head
    (hidden state -> 8 codebook ids, greedy) and the code embedder (ids -> next input)."""

    def __init__(self, key: str, depth_head: Any, embedder: Any, placeholder_id: int) -> None:
        self.key, self.placeholder_id = key, placeholder_id
        self.depth_head, self.embedder = depth_head, embedder

    def codes(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.depth_head.generate(hidden, temperature=0.0)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        return self.embedder(codes)


class _Stage(NamedTuple):
    """One media output of a turn."""

    head: MediaHead
    tokens: int  # media tokens to make
    chunk: int  # stream them in chunks of this many (0: all at once)
    cfg: float | None  # classifier-free guidance scale, or None
    grid: list[int] | None  # an image's [h, w]
    first: int = 0  # the first chunk's tokens (0: chunk)


class _Session:
    __slots__ = ("tokens", "spans", "key", "messages")

    def __init__(self, key: int = 0) -> None:
        self.tokens: list[int] = []
        self.spans: list[EmbeddingSpan] = []
        self.messages: list[dict[str, Any]] = []  # what the tokens render, reply included
        self.key = key  # summary_key("session", id): what the routing summary publishes


class LLMRole(ModelActor):
    Options = LLMOptions
    Params = LLMParams
    Makes = ("text",)
    options: LLMOptions

    async def setup(self) -> None:
        opts = self.options
        self.path = Path(opts.model_path)
        self.start_model_thread(f"{self.role}-heads")
        if opts.build_tiny:
            await self._run(self._build_tiny, opts.tiny_preset, opts.hidden_size, opts.seed)
        device = opts.device
        cache = self.cache_config
        ssd_kv_mb = opts.ssd_kv_mb
        config = EngineConfig(
            device=device,
            kv_cache_bytes=opts.kv_cache_mb << 20,
            # The radix tree keys media positions by content hash, per turn and session.
            prefix_cache=opts.prefix_cache,
            # Evicted KV pages go to the deployment's host pool, then to [cache] ssd_dir.
            host_kv_bytes=opts.host_kv_mb << 20,
            ssd_kv_dir=(cache.ssd_dir or None) if cache is not None and ssd_kv_mb else None,
            ssd_kv_bytes=ssd_kv_mb << 20,
            share_kv=opts.share_kv and self.pool is not None,
            # backend sglang serves the text stage only (image/audio are refused by name).
            backend=opts.backend,
            dtype=opts.dtype,
            max_num_seqs=opts.max_num_seqs,
            max_model_len=opts.max_model_len,
        )
        self.tokenizer = load_tokenizer(self.path)
        try:
            llm_engine = LLMEngine(self.path, config, kv_pool=self.pool)
        except CheckpointError as e:
            raise CheckpointError(f"role {self.role}: {e}") from None
        except ValueError as e:  # the checkpoint's tensors do not fit: name role and folder
            raise CheckpointError(f"role {self.role}: {e}") from None
        self.engine = AsyncEngine(
            llm_engine,
            thread_setup=functools.partial(lower_thread_priority, self.model_nice),
            on_death=self.engine_died,
        )
        self.generation_defaults = generation_defaults(self.path)
        omni = self.path / "omni"
        self.hidden_size = self.engine.backend.model_config.hidden_size  # type: ignore[attr-defined]
        self.vocab_size: int = self.engine.backend.vocab_size  # type: ignore[attr-defined]
        # Media positions hold a placeholder id; their embeddings replace its embedding.
        self.placeholder = self.tokenizer.tokenizer.token_to_id("<pad>") or 0
        self.bos = self.tokenizer.encode("", add_special_tokens=True) or [self.placeholder]
        try:
            template = ChatTemplate(*load_chat_template(self.path, opts.chat_template))
        except TemplateError as e:
            raise ValueError(f"llm option chat_template: {e}") from None
        self.prompts = PromptBuilder(self.tokenizer, template, self.placeholder)
        # The engine runs them (on its thread) after the LLM's step, for media tokens. A
        # plain LLM checkpoint has none (no omni/ folder): it makes text only.
        if is_next_folder(self.path):  # the published layout: visual_head, audio_head
            heads = load_next_media_heads(self.path, self.placeholder, device, self.role)
            self.image_head, self.audio_head = cast(tuple[Any, Any], heads)
        else:
            self.image_head = self._media_head("image", omni, device)
            self.audio_head = self._media_head("audio", omni, device)
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.max_sessions = opts.max_sessions
        self.leading_media: OrderedDict[int, None] = OrderedDict()  # summary keys, LRU
        self.summary_media = opts.summary_media
        self._ids = itertools.count()

    def _media_head(self, kind: str, omni: Path, device: str) -> MediaHead | None:
        head, embedder = omni / f"{kind}_head", omni / f"{kind}_embedder"
        if not (has_model(head) or has_model(embedder)):
            return None
        return MediaHead(
            kind,
            load_depth_head(head, device),
            load_model("code_embedder", embedder, device),
            self.placeholder,
        )

    def _build_tiny(self, preset: str, hidden: int, seed: int) -> None:
        if preset == "longcat-next-tiny":  # the folder the encoders share (atomic)
            ensure_next(self.path, seed, hidden)
            return
        # Only where model_path names no folder yet, atomically (roles/tiny_build.py): an
        # existing checkpoint is never written into.
        build_atomically(self.path, functools.partial(self._build_tiny_into, preset, hidden, seed))

    @staticmethod
    def _build_tiny_into(preset: str, hidden: int, seed: int, folder: Path) -> None:
        build_tiny_model(folder, preset, seed=seed, hidden_size=hidden, vocab_size=512)
        omni = folder / "omni"
        ensure_model(
            "depth_head",
            omni / "image_head",
            seed + 1,
            hidden_size=hidden,
            codebook_sizes=IMAGE_CODEBOOKS,
        )
        ensure_model(
            "depth_head",
            omni / "audio_head",
            seed + 2,
            hidden_size=hidden,
            codebook_sizes=AUDIO_CODEBOOKS,
        )
        ensure_model(
            "code_embedder",
            omni / "image_embedder",
            seed + 3,
            hidden_size=hidden,
            codebook_sizes=IMAGE_CODEBOOKS,
        )
        ensure_model(
            "code_embedder",
            omni / "audio_embedder",
            seed + 4,
            hidden_size=hidden,
            codebook_sizes=AUDIO_CODEBOOKS,
        )

    async def use_kv_peers(self, peers: KVPeers) -> None:
        """Serve this engine's prefix pages to the other replicas and pull from them; the
        worker calls it after setup, before the replica registers."""
        if not self.options.kv_pull:
            return
        self.prefixes = EnginePrefixes(self.engine)
        self.pull_cost = PullCost(prefill=self.engine.backend.prefill_rate)  # type: ignore[attr-defined]
        self.kv_endpoint = peers.serve(self.prefixes)
        self.kv_peers: KVPeers | None = peers
        self.pulls = {"pulled": 0, "recomputed": 0, "failed": 0}
        self._pulling: dict[int, asyncio.Future] = {}  # summary key -> its pull, running

    async def close(self) -> None:
        peers = getattr(self, "kv_peers", None)
        if peers is not None:  # pins go back to the engine before it stops
            await peers.close()
        engine = getattr(self, "engine", None)
        if engine is not None:  # None: setup failed before the engine was made
            await engine.close()
        await super().close()

    # ------------------------------------------------------------------ requests

    async def handle(self, request: Request, ctx: Context):
        read_params(LLMParams, request.params)  # types and ranges, each error naming its key
        want = _want(request.params)
        text = request.data.get("text", "")
        if not isinstance(text, str):
            raise BadRequest("text", f"expected a string, got {type(text).__name__}")
        stages = self._media_stages(request, want)  # validated before anything runs
        session = self._session(request.session)
        media = media_inputs(request, self.hidden_size)
        messages, whole = request_messages(request.data, text, media)
        messages, prompt, all_spans = self._prompt(request, session, messages, whole, media)
        pull = None
        if not session.tokens:
            pull = self._prefix_holder(all_spans)
            self._note_leading_media(all_spans)
        if pull is not None:
            await self._pull_prefix(request.request_id, *pull, prompt, all_spans)
        params = self._sampling(request)
        if "text" in want:
            _check_length(len(prompt), params.max_tokens, self.engine.backend.limits)  # type: ignore[attr-defined]
        # A migrated request (runtime/client.py): the text tokens its dead replica streamed
        # are prefilled with the prompt and generation goes on after them.
        resumed, text_done = _resume(request.params, self.vocab_size)
        generated: list[int] = list(resumed)
        # One sequence for the whole turn: each stage goes on from the last one's KV (kept
        # by the engine in between), so text, image and audio tokens never re-prefill.
        kept: list[str] = []
        previous: str | None = None
        reply = ""  # the text sent, stop strings cut
        try:
            if "text" in want and not text_done and params.max_tokens > len(resumed):
                rid = f"{request.request_id}-{next(self._ids)}"
                stream = self.tokenizer.stream()
                stream.push(resumed)  # the client has their text: only what follows is sent
                if resumed:
                    params = dataclasses.replace(
                        params, max_tokens=params.max_tokens - len(resumed)
                    )
                first = True
                unsent: list[int] = []  # ids whose text is not out yet (a partial character)
                stops = StopText(params.stop)
                async for delta in self.engine.generate(
                    rid, prompt + resumed, params, all_spans or None, keep=bool(stages)
                ):
                    if first:
                        ctx.add_usage(cached_tokens=delta.num_cached_tokens)
                        first = False
                    generated += delta.token_ids
                    unsent += delta.token_ids
                    piece = stream.push(delta.token_ids)
                    finished = delta.finish_reason is not None
                    if finished:
                        piece += stream.finish()
                    piece = stops.push(piece, finished)
                    reply += piece
                    if piece or finished or params.logprobs is not None:
                        # "tokens": what a migration resumes from; "finished": nothing follows
                        text_out: dict[str, Any] = {"text": piece, "tokens": unsent}
                        if params.logprobs is not None:
                            text_out["logprobs"] = token_logprobs(self.tokenizer, delta)
                        if finished:
                            text_out["finished"] = True
                            text_out["finish_reason"] = delta.finish_reason
                        unsent = []
                        yield text_out
                if not resumed:  # so a resent dialogue gets these very ids back
                    self.prompts.remember(reply, generated)
                ctx.add_usage(prompt_tokens=len(prompt), completion_tokens=len(generated))
                if stages:
                    kept.append(rid)
                    previous = rid
            elif "text" in want:  # resumed after the text ended: the media stages go on
                ctx.add_usage(prompt_tokens=len(prompt), completion_tokens=len(generated))
            elif not stages:  # every LLM request reports it
                ctx.add_usage(cached_tokens=0)
            tokens = prompt + generated
            for index, stage in enumerate(stages):
                rid = f"{request.request_id}-{next(self._ids)}"
                keep = index + 1 < len(stages)
                codes = []
                media = self._media(rid, stage, tokens, all_spans, previous, keep, ctx)
                async for out in media:
                    if isinstance(out, torch.Tensor):
                        codes.append(out)
                    else:
                        yield out
                if keep:
                    kept.append(rid)
                previous = rid
                ids = torch.cat(codes)
                rows = await self._run(_embed_codes, stage.head, ids)  # off the event loop
                keys = [codes_key(stage.head, row) for row in ids]
                all_spans = all_spans + [EmbeddingSpan(len(tokens), rows, keys)]
                tokens = tokens + [self.placeholder] * len(ids)
        finally:
            for rid in kept:  # a stage that went on already took it: a no-op then
                self.engine.release(rid)
        if request.session:  # the next turn starts from all of this one, media included
            session.tokens = tokens
            session.spans = all_spans
            reply_text = reply if "text" in want and not text_done else ""
            session.messages = [*messages, {"role": "assistant", "content": reply_text}]

    def _media_stages(self, request: Request, want: set[str]) -> list[_Stage]:
        """The image stage (guided) and the audio stage this request wants, checked."""
        stages = []
        if want & {"image", "audio"} and self.options.backend == "sglang":
            raise BadRequest(
                "params.want", "image and audio need codes heads: backend 'sglang' makes text only"
            )
        for kind in sorted(want & {"image", "audio"}):
            if getattr(self, f"{kind}_head") is None:
                raise BadRequest(
                    "params.want",
                    f"{self.path} has no {kind} head (omni/{kind}_head): this model makes text only",
                )
        if "image" in want:
            grid = request.params.get("image_grid", [4, 4])
            if not (
                isinstance(grid, list)
                and len(grid) == 2
                and all(isinstance(g, int) and 1 <= g <= 32 for g in grid)
            ):
                raise BadRequest(
                    "params.image_grid", f"expected [h, w] with 1..32 tokens each, got {grid!r}"
                )
            scale = float(request.params.get("cfg_scale", 2.0))
            stages.append(
                _Stage(cast(MediaHead, self.image_head), grid[0] * grid[1], 0, scale, list(grid))
            )
        if "audio" in want:
            chunks = int(request.params.get("audio_chunks", 3))
            per_chunk = int(request.params.get("audio_chunk_tokens", 4))
            if not (1 <= chunks <= 64 and 1 <= per_chunk <= 256):
                raise BadRequest("params.audio_chunks", "expected 1..64 chunks of 1..256 tokens")
            # The first chunk sooner: the time to first audio waits for its tokens only.
            first = int(request.params.get("audio_first_chunk_tokens", 1)) or per_chunk
            head = cast(MediaHead, self.audio_head)
            stages.append(_Stage(head, chunks * per_chunk, per_chunk, None, None, first))
        return stages

    async def _media(self, rid, stage, tokens, spans, previous, keep, ctx):
        """One media stage through the engine, going on from request ``previous`` (or from
        the prompt ``tokens``, then reporting its cache hit): yields each delta's new ids
        [n, K] (for the session), then the outputs: one image at the end, or audio chunks as
        they complete."""
        guidance = None if stage.cfg is None else Guidance(self.bos, stage.cfg)
        options = dict(head=stage.head, guidance=guidance, keep=keep, continue_from=previous)
        prompt, spans = (tokens, spans or None) if previous is None else ([], None)
        params = SamplingParams(max_tokens=stage.tokens)
        buffered: list[torch.Tensor] = []  # ids rows not yet sent
        index = 0
        first = previous is None
        async for delta in self.engine.generate(rid, prompt, params, spans, **options):
            if first:
                ctx.add_usage(cached_tokens=delta.num_cached_tokens)
                first = False
            if delta.codes is None:
                continue
            yield delta.codes
            buffered += list(delta.codes)
            size = (stage.first or stage.chunk) if index == 0 else stage.chunk
            while stage.chunk and len(buffered) >= size:
                chunk, buffered = buffered[:size], buffered[size:]
                yield {"audio_codes": torch.stack(chunk).cpu(), "index": index}
                index += 1  # streams on while the next chunk is made
                size = stage.chunk
        if stage.chunk and buffered:  # what a short first chunk left over
            yield {"audio_codes": torch.stack(buffered).cpu(), "index": index}
        if stage.grid is not None:
            yield {"image_codes": torch.stack(buffered).cpu(), "image_grid": stage.grid}

    def meta(self) -> dict[str, Any]:
        """The routing summary: sessions held here, then media that began recent prompts;
        and where to pull KV pages from this replica."""
        sessions = getattr(self, "sessions", {})
        media = getattr(self, "leading_media", {})
        # RESUMABLE_META: a request on a replica that dies goes on at another (migration).
        meta = {
            SUMMARY_META: [s.key for s in sessions.values()] + list(media),
            RESUMABLE_META: True,
        }
        if getattr(self, "kv_peers", None) is not None:
            meta[KV_PULL_META] = self.kv_endpoint
            meta["kv_pulls"] = dict(self.pulls)
        return meta

    def figures(self) -> dict[str, float]:
        engine = getattr(self, "engine", None)
        return {} if engine is None else engine_figures(engine.backend)

    def describe(self) -> dict[str, Any]:
        return {"model": str(self.path), **engine_description(self.engine.backend)}

    def _prefix_holder(self, spans: list[EmbeddingSpan]) -> tuple[int, Any] | None:
        """(summary key, record) of another replica holding the KV of the media that opens a
        fresh prompt, unseen here; None (at the cost of a dict lookup) when there is none."""
        if getattr(self, "kv_peers", None) is None or not spans:
            return None
        kind, name = cast(tuple[str, str], spans[0].content_hash)  # as _turn makes them
        key = summary_key(kind, str(name))
        if key in self.leading_media and key not in self._pulling:
            return None
        holders = self.kv_peers.holders(key)  # type: ignore[union-attr]
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
            kind, name = cast(tuple[str, str], span.content_hash)  # as _turn makes them
            key = summary_key(kind, str(name))
            self.leading_media[key] = None
            self.leading_media.move_to_end(key)
        while len(self.leading_media) > self.summary_media:
            self.leading_media.popitem(last=False)

    def _session(self, session_id: str) -> _Session:
        if not session_id:
            return _Session()
        session = self.sessions.get(session_id)
        if session is None:
            key = summary_key("session", session_id)
            session = self.sessions[session_id] = _Session(key)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(session_id)
        return session

    def _prompt(
        self,
        request: Request,
        session: _Session,
        messages: list[dict[str, Any]],
        whole: bool,
        media: Media,
    ) -> tuple[list[dict[str, Any]], list[int], list[EmbeddingSpan]]:
        """(the dialogue, its prompt, its spans): the session's tokens and the new messages'
        when the dialogue extends the session's, else the whole dialogue rendered (the
        prefix cache then serves what it shares with the session)."""
        raw = request.data.get("prompt")
        if isinstance(raw, str):  # /v1/completions: the text as it is, no chat template
            return messages, list(self.bos) + self.tokenizer.encode(raw, False), []
        history = session.messages
        if session.tokens and not whole:  # a turn of its own (omniflow send): it follows on
            messages = history + messages
        n = len(history)
        if session.tokens and len(messages) > n and messages[:n] == history:
            following = self.prompts.continuation(history, messages, media, len(session.tokens))
            if following is not None:
                return messages, session.tokens + following[0], session.spans + following[1]
        elif session.tokens and whole:
            at = next(
                (i for i, (a, b) in enumerate(zip(history, messages, strict=False)) if a != b), n
            )
            log.info(
                "request %s: the dialogue diverges from session %s at message %d; prompted whole",
                request.request_id,
                request.session,
                at,
            )
        if session.tokens and not whole:  # the template is not prefix-stable: as a new turn
            tokens, spans = self.prompts.full(messages[n:], media, len(session.tokens))
            return messages, session.tokens + tokens, session.spans + spans
        tokens, spans = self.prompts.full(messages, media)
        return messages, tokens, spans

    def _sampling(self, request: Request) -> SamplingParams:
        values = {k: request.params[k] for k in _SAMPLING_KEYS if k in request.params}
        cap = self.options.max_tokens
        for key, value in self.generation_defaults.items():  # the checkpoint's, capped
            values.setdefault(key, min(value, cap) if key == "max_tokens" else value)
        values.setdefault("max_tokens", 16)
        if isinstance(values["max_tokens"], int) and values["max_tokens"] > cap:
            raise BadRequest(
                "params.max_tokens", f"{values['max_tokens']} exceeds this role's cap of {cap}"
            )
        try:
            return SamplingParams.from_dict(values, request.request_id)
        except (TypeError, ValueError) as e:
            raise BadRequest("params", str(e)) from None


# generation_config.json keys -> sampling params (the checkpoint's defaults; a request's own
# values win).
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults ``generation_config.json`` sets (``do_sample: false``: greedy)."""
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file}: not JSON ({e})") from None
    out = {ours: raw[theirs] for theirs, ours in _GENERATION_KEYS.items() if theirs in raw}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def _check_length(prompt_len: int, max_tokens: int, limits: Any) -> None:
    """A prompt past the context, or max_tokens past what is left of it: bad requests,
    refused before the engine sees them."""
    limit = min(limits.max_model_len, limits.capacity_tokens)
    name = "max_model_len" if limit == limits.max_model_len else "the KV cache's capacity"
    if prompt_len >= limit:
        raise BadRequest("text", f"the prompt is {prompt_len} tokens, past {name} {limit}")
    if prompt_len + max_tokens > limit:
        raise BadRequest(
            "params.max_tokens",
            f"{max_tokens} past the context: the prompt's {prompt_len} tokens + {max_tokens} "
            f"exceed {name} {limit}; at most {limit - prompt_len}",
        )


def _embed_codes(head: MediaHead, ids: torch.Tensor) -> torch.Tensor:
    """The input rows of media tokens [n, K], as the engine fed them: the session's spans."""
    with torch.inference_mode():
        return head.embed(ids)


def _resume(params: dict[str, Any], vocab_size: int) -> tuple[list[int], bool]:
    """``params["resume"]`` of a migrated request: (text token ids already streamed,
    whether the text had ended)."""
    resume = params.get("resume")
    if resume is None:
        return [], False
    tokens = resume.get("tokens", []) if isinstance(resume, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens
    ):
        raise BadRequest("params.resume.tokens", f"expected a list of ids below {vocab_size}")
    return tokens, bool(resume.get("finished", False))


def _want(params: dict[str, Any]) -> set[str]:
    want = params.get("want", "text")
    kinds = {w.strip() for w in (want.split(",") if isinstance(want, str) else want)}
    unknown = kinds - {"text", "image", "audio"}
    if unknown or not kinds:
        raise BadRequest("params.want", f"expected some of text,image,audio; got {want!r}")
    return kinds
