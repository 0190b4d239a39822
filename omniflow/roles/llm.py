"""``llm`` role: the LongCat-style omni LLM — text in/out, image and audio tokens out.

Input (joined from the client and the encoders):
    data["messages"]: [{role, content}]    the dialogue, rendered by the chat template
                                           (llm_prompt.py); or data["text"]: one user turn;
                                           or data["prompt"]: raw text, no template
    tensors["image_embeds"] [N, hidden], data["image_hash"]    from vision_encoder (optional)
    tensors["audio_embeds"] [M, hidden], data["audio_hash"]    from audio_encoder (optional)
    params: want ("text,image,audio"), max_tokens, temperature, top_p, top_k, seed,
            image_grid [h, w], cfg_scale, audio_chunks, audio_chunk_tokens,
            audio_first_chunk_tokens (the first chunk sooner; default 1),
            audio_text (parallel: text made beside the audio; serial: before it)
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
audio each go on from the last stage's KV. A turn of text and audio on a model with the
audiotext tokens (the published layout) speaks as LongCat-Next does (engine/spoken.py):
parallel, each audio step samples a text token too and its row carries both; serial, the
text first in the speech block, then the audio alone. A parallel text is at most one token
longer than its audio (audio_chunks x audio_chunk_tokens): a longer one is cut ("length").
Random weights cannot choose a modality, so ``want`` forces which outputs are made.

Options: ``LLMOptions`` in roles/options.py. ``hidden_size`` of a build_tiny model must
match the encoders'. ``host_kv_mb``: KV pages evicted from the device go to this much of
the deployment's host pool (0: dropped), ``ssd_kv_mb``: and below that to this much of
``[cache] ssd_dir``, at most the replica's fair part of the host's cache.ssd_capacity
(memory/ssd_share.py); ``share_kv``: K/V tensors in the host pool, so the engine can lend a
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

import dataclasses
import functools
import itertools
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, cast

import torch

from omniflow.content import SUMMARY_META, summary_key
from omniflow.engine import (
    AsyncEngine,
    EmbeddingSpan,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    Spoken,
    TokenDelta,
)
from omniflow.engine.heads import codes_key
from omniflow.memory import SsdShare
from omniflow.models.loader import load_tokenizer
from omniflow.models.omni.checkpoint import CheckpointError, ensure_next, is_next_folder
from omniflow.models.omni.next_media import SpeechTokens, load_next_media_heads
from omniflow.models.tiny.builder import build_tiny_model
from omniflow.roles.base import ModelActor
from omniflow.roles.chat_template import ChatTemplate, TemplateError, load_chat_template
from omniflow.roles.llm_media import (
    AUDIO_CODEBOOKS,
    IMAGE_CODEBOOKS,
    MediaHead,
    Stage,
    build_tiny_heads,
    embed_codes,
    load_media_head,
    media_layout,
    media_stages,
    run_stage,
    speech_tokens,
    spoken_layout,
    spoken_rows,
)
from omniflow.roles.llm_prompt import (
    Media,
    PromptBuilder,
    TextDeltas,
    media_inputs,
    request_messages,
    token_logprobs,
)
from omniflow.roles.llm_pulls import PrefixPulls
from omniflow.roles.llm_request import (
    Session,
    check_length,
    generation_defaults,
    resume_point,
    sampling,
    wanted,
)
from omniflow.roles.options import LLMOptions, LLMParams, read_params
from omniflow.roles.ssd_sharers import deployment_ssd_sharers
from omniflow.roles.tiny_build import build_atomically
from omniflow.runtime.actor import RESUMABLE_META, BadRequest, Context, Request
from omniflow.runtime.kv_peers import KV_PULL_META
from omniflow.runtime.priority import lower_thread_priority

log = logging.getLogger(__name__)
__all__ = ["AUDIO_CODEBOOKS", "IMAGE_CODEBOOKS", "LLMRole", "MediaHead", "generation_defaults"]


class _Turn:
    """What one request's stages share: the text made, and the kept request the next stage
    goes on from."""

    def __init__(self, resumed: list[int]) -> None:
        self.generated: list[int] = list(resumed)
        self.reply = ""  # the text sent, stop strings cut
        self.kept: list[str] = []
        self.previous: str | None = None
        self.closing: tuple[int, ...] = ()  # the last stage's closing tokens, not fed yet


class LLMRole(PrefixPulls, ModelActor):
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
        ssd_dir, ssd_share = self._ssd_kv_share()
        config = EngineConfig(
            device=device,
            kv_cache_bytes=opts.kv_cache_mb << 20,
            # Evicted KV pages go to the deployment's host pool, then to [cache] ssd_dir.
            host_kv_bytes=opts.host_kv_mb << 20,
            ssd_kv_dir=ssd_dir,
            ssd_kv_bytes=opts.ssd_kv_mb << 20,
            ssd_kv_share=ssd_share,
            share_kv=opts.share_kv and self.pool is not None,
            # backend sglang serves the text stage only (image/audio are refused by name).
            backend=opts.backend,
            dtype=opts.dtype,
            max_num_seqs=opts.max_num_seqs,
            max_model_len=opts.max_model_len,
        )
        self.tokenizer = load_tokenizer(self.path)
        try:
            self.llm = LLMEngine(self.path, config, kv_pool=self.pool)
        except CheckpointError as e:
            raise CheckpointError(f"role {self.role}: {e}") from None
        except ValueError as e:  # the checkpoint's tensors do not fit: name role and folder
            raise CheckpointError(f"role {self.role}: {e}") from None
        tiers = self.llm.tiers
        if ssd_share is not None and tiers is not None and tiers.ssd is None:
            log.warning(
                "role %s replica %d: no SSD KV tier: cache.ssd_capacity (%d bytes in %s, "
                "shared by %d processes on this host) has less than a page left for it",
                self.role,
                self.replica,
                ssd_share.capacity,
                ssd_dir,
                ssd_share.sharers,
            )
        self.engine = AsyncEngine(
            self.llm,
            thread_setup=functools.partial(lower_thread_priority, self.model_nice),
            on_death=self.engine_died,
        )
        self.generation_defaults = generation_defaults(self.path)
        self.hidden_size = self.llm.model_config.hidden_size
        self.vocab_size: int = self.llm.vocab_size
        # Media positions hold a placeholder id; their embeddings replace its embedding.
        self.placeholder = self.tokenizer.tokenizer.token_to_id("<pad>") or 0
        self.bos = self.tokenizer.encode("", add_special_tokens=True) or [self.placeholder]
        try:
            template = ChatTemplate(*load_chat_template(self.path, opts.chat_template))
        except TemplateError as e:
            raise ValueError(f"llm option chat_template: {e}") from None
        self.prompts = PromptBuilder(self.tokenizer, template, self.placeholder)
        self._load_heads(device)
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.max_sessions = opts.max_sessions
        self.leading_media = OrderedDict()  # summary keys, LRU
        self.summary_media = opts.summary_media
        self._ids = itertools.count()

    def _ssd_kv_share(self) -> tuple[str | None, SsdShare | None]:
        """Where evicted KV pages go below the host tier (``[cache] ssd_dir``, with
        ``host_kv_mb`` and ``ssd_kv_mb``), as this replica's share of the host's
        cache.ssd_capacity (memory/ssd_share.py); (None, None) without one."""
        cache = self.cache_config
        if cache is None or not cache.ssd_dir or not self.options.spills_to_ssd():
            return None, None
        name = f"kv-{self.role}-{self.replica}"
        return cache.ssd_dir, SsdShare(cache.ssd_capacity_bytes, name, deployment_ssd_sharers())

    def _load_heads(self, device: str) -> None:
        """The engine runs them (on its thread) after the LLM's step, for media tokens. A
        plain LLM checkpoint has none (no omni/ folder): it makes text only."""
        self.heads: dict[str, Any]  # MediaHead or NextMediaHead, or None
        if is_next_folder(self.path):  # the published layout: visual_head, audio_head
            image, audio = load_next_media_heads(self.path, self.placeholder, device, self.role)
            self.heads = {"image": image, "audio": audio}
        else:
            omni = self.path / "omni"
            self.heads = {
                kind: load_media_head(kind, omni, device, self.placeholder)
                for kind in ("image", "audio")
            }
        self.image_head, self.audio_head = self.heads["image"], self.heads["audio"]

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
        build_tiny_heads(folder / "omni", hidden, seed)

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
        want = wanted(request.params)
        text = request.data.get("text", "")
        if not isinstance(text, str):
            raise BadRequest("text", f"expected a string, got {type(text).__name__}")
        # validated before anything runs
        stages = media_stages(
            request, want, self.options.backend, self.heads, self.path, self.tokenizer
        )
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
        params = sampling(request, self.generation_defaults, self.options.max_tokens)
        if "text" in want:
            check_length(len(prompt), params.max_tokens, self.llm.limits)
        # A migrated request (runtime/client.py): the text tokens its dead replica streamed
        # are prefilled with the prompt and generation goes on after them.
        resumed, text_done = resume_point(request.params, self.vocab_size)
        # One sequence for the whole turn: each stage goes on from the last one's KV (kept
        # by the engine in between), so text, image and audio tokens never re-prefill.
        turn = _Turn(resumed)
        # The text made beside the audio, in one decode (the published parallel speech).
        spoken = self._spoken(request.params, want, stages, resumed, params.max_tokens)
        speaks = spoken is not None
        try:
            if not speaks and "text" in want and not text_done and params.max_tokens > len(resumed):
                text_stage = self._text(request, prompt, all_spans, params, bool(stages), turn, ctx)
                async for out in text_stage:
                    yield out
                ctx.add_usage(prompt_tokens=len(prompt), completion_tokens=len(turn.generated))
            elif not speaks and "text" in want:  # resumed after the text ended: media go on
                ctx.add_usage(prompt_tokens=len(prompt), completion_tokens=len(turn.generated))
            elif not stages:  # every LLM request reports it
                ctx.add_usage(cached_tokens=0)
            tokens = prompt + turn.generated
            for index, stage in enumerate(stages):
                keep = index + 1 < len(stages)
                run = self._media(
                    request, stage, tokens, all_spans, keep, turn, ctx, spoken, params
                )
                async for out in run:
                    if isinstance(out, tuple):
                        tokens, all_spans = out
                    else:
                        yield out
            if speaks:
                ctx.add_usage(prompt_tokens=len(prompt), completion_tokens=len(turn.generated))
        finally:
            for rid in turn.kept:  # a stage that went on already took it: a no-op then
                self.engine.release(rid)
        if request.session:  # the next turn starts from all of this one, media included
            # A reply's closing eos set apart: the next turn's template renders the turn's
            # end, as it does for the same dialogue resent whole.
            session.tokens = tokens if stages else prompt + self.prompts.without_eos(turn.generated)
            session.ended = tokens[len(session.tokens) :]
            session.spans = all_spans
            reply_text = turn.reply if "text" in want and not text_done else ""
            session.messages = [*messages, {"role": "assistant", "content": reply_text}]

    async def _text(
        self,
        request: Request,
        prompt: list[int],
        spans: list[EmbeddingSpan],
        params: SamplingParams,
        keep: bool,
        turn: _Turn,
        ctx: Context,
    ):
        """The text stage: yields the text deltas; with ``keep``, its request is kept for
        the media stages to go on from (``turn.previous`` names it then)."""
        resumed = list(turn.generated)  # a migrated request's: already streamed
        rid = f"{request.request_id}-{next(self._ids)}"
        if resumed:
            params = dataclasses.replace(params, max_tokens=params.max_tokens - len(resumed))
        first = True
        text = TextDeltas(self.tokenizer, params.stop, resumed)
        async for delta in self.engine.generate(
            rid, prompt + resumed, params, spans or None, keep=keep
        ):
            if first:
                ctx.add_usage(cached_tokens=delta.num_cached_tokens)
                first = False
            turn.generated += delta.token_ids
            out = text.push(delta.token_ids, delta.finish_reason, params.logprobs is not None)
            if out is not None:
                if params.logprobs is not None:
                    out["logprobs"] = token_logprobs(self.tokenizer, delta)
                yield out
        turn.reply = text.reply
        if not resumed:  # so a resent dialogue gets these very ids back
            self.prompts.remember(turn.reply, turn.generated)
        if keep:
            turn.kept.append(rid)
            turn.previous = rid

    async def _media(
        self,
        request: Request,
        stage: Stage,
        tokens: list[int],
        spans: list[EmbeddingSpan],
        keep: bool,
        turn: _Turn,
        ctx: Context,
        spoken: Spoken | None = None,
        params: SamplingParams | None = None,
    ):
        """One media stage, going on from ``turn.previous``: yields its outputs, then (the
        turn's tokens, its spans) with this stage's media tokens added. ``spoken``: the
        turn's text is made beside its audio, sampled by ``params``."""
        rid = f"{request.request_id}-{next(self._ids)}"
        codes, steps = [], []
        text, prompt = None, tokens
        if spoken is not None and params is not None:
            text = TextDeltas(self.tokenizer, params.stop, [])
            # as the model would route itself: <audiogen_start> opens the speech
            prompt = tokens + [cast(SpeechTokens, speech_tokens(stage.head)).gen_start]
        run = run_stage(
            self.engine, self.bos, rid, stage, prompt, spans, turn.previous, keep, ctx,
            spoken, text, params, turn.closing,
        )  # fmt: skip
        async for out in run:
            if isinstance(out, TokenDelta):
                if out.codes is not None:
                    codes.append(out.codes)
                steps += out.text_ids or []
            else:
                yield out
        if keep:
            turn.kept.append(rid)
        turn.previous, turn.closing = rid, stage.closing
        ids = torch.cat(codes)
        if spoken is not None and text is not None:
            turn.generated, turn.reply = text.ids, text.reply
            model = self.llm.model
            rows, keys = await self._run(spoken_rows, model, stage.head, spoken, steps, ids)
            layout = spoken_layout(stage, spoken, tokens, spans, rows, keys, self.placeholder)
            # a stateless client resends the reply's text: it gets back this speech
            self.prompts.remember_spoken(turn.reply, layout[0][len(tokens) :], 1, rows, keys)
            yield layout
            return
        rows = await self._run(embed_codes, stage.head, ids)  # off the event loop
        keys = [codes_key(stage.head, row) for row in ids]
        yield media_layout(stage, tokens, spans, rows, keys, self.placeholder)

    def _spoken(
        self, given: dict[str, Any], want: set[str], stages: list[Stage], resumed: list[int],
        max_text: int,
    ) -> Spoken | None:  # fmt: skip
        """How a turn of text and audio only (not a migrated one) speaks, where the audio
        head has the audiotext tokens: params.audio_text parallel (the default) or serial."""
        mode = given.get("audio_text", "")
        if not {"text", "audio"} <= want or "image" in want or resumed:
            return None
        ids = speech_tokens(stages[-1].head)
        if ids is None:
            if mode == "parallel":
                raise BadRequest(
                    "params.audio_text",
                    f"{self.path} has no audiotext tokens for its audio head: only serial",
                )
            return None
        ends, audio = frozenset({ids.text_pad, *self.llm.eos_token_ids}), stages[-1].tokens
        return Spoken(ids.text_start, ends, max_text, audio if mode == "serial" else None)

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

    def describe(self) -> dict[str, Any]:
        return {"model": str(self.path), **self.engine.description()}

    def _session(self, session_id: str) -> Session:
        if not session_id:
            return Session()
        session = self.sessions.get(session_id)
        if session is None:
            key = summary_key("session", session_id)
            session = self.sessions[session_id] = Session(key)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(session_id)
        return session

    def _prompt(
        self,
        request: Request,
        session: Session,
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
            before = session.tokens + session.ended
            tokens, spans = self.prompts.full(messages[n:], media, len(before))
            return messages, before + tokens, session.spans + spans
        tokens, spans = self.prompts.full(messages, media)
        return messages, tokens, spans
