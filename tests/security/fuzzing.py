"""What a stranger can send, as hypothesis strategies, and the checks each input must pass.

Four surfaces: the ZeroMQ wire protocol (raw multipart messages to a live actor), the
HTTP API (raw bodies to a live gateway), TOML configs and the media decoders. Each
``check_*`` runs one input and records it in a ``Tally``: an input must end in a clear
error (a ``Fail`` with a known code and a message; an HTTP 4xx with an error body; a
``ConfigError``; a ``BadRequest``) or be served. The tests in this folder and
``benchmarks/fuzz.py`` share this module.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
import wave
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx
import msgspec
from hypothesis import strategies as st

from omniflow.memory.dtypes import ITEMSIZE
from omniflow.memory.pool import received
from omniflow.messages import Call, Cancel, Code, Done, Fail
from omniflow.transport.codec import BadMessage, decode, encode

CODES = {c.value for c in Code}
REPLY_TIMEOUT = 10.0


@dataclass
class Tally:
    tried: dict[str, int] = field(
        default_factory=lambda: {"wire": 0, "http": 0, "config": 0, "media": 0}
    )
    unclear: list[str] = field(default_factory=list)

    def unclear_error(self, surface: str, what: str) -> None:
        self.unclear.append(f"{surface}: {what}"[:500])


# ------------------------------------------------------------------ plain values

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
dtypes = st.sampled_from([*ITEMSIZE, "complex64", "", "object", "float32\x00", "<f4"])
_hostile_dims = st.integers(-(2**63), 2**63 - 1) | st.sampled_from([-1, 2**40, 2**40 + 1])
_good_shapes = st.lists(st.integers(0, 4), max_size=4)
# Mostly shapes the decoder takes (so that frames, sizes and pool refs get tested),
# some with a hostile dimension, some with too many dimensions.
shapes = st.one_of(
    _good_shapes,
    _good_shapes,
    _good_shapes,
    st.lists(st.integers(0, 4) | _hostile_dims, min_size=1, max_size=4),
    st.lists(st.integers(0, 2), min_size=15, max_size=20),
)


# ------------------------------------------------------------------ the wire


@dataclass
class ShmSpec:
    """A pool ref made at check time: ``kind`` says whose ref it is, deltas forge it."""

    kind: str  # held (for the actor), unshared (held for us), stale, random
    dtype: str
    shape: list[int]
    offset_delta: int
    lease_delta: int
    pool: str | None  # None: the deployment's own


shm_specs = st.builds(
    ShmSpec,
    st.sampled_from(["held", "unshared", "stale", "random"]),
    st.sampled_from(["float32", "uint8", "bfloat16", "complex64"]),
    st.sampled_from([[16], [4, 4], [64], [2, 8]])
    | st.lists(st.integers(0, 20), max_size=3)
    | shapes,
    st.sampled_from([0, 0, 0, 1, 4, -4, 65536, -(2**20), 2**40]),
    st.sampled_from([0, 0, 0, 1, -1, 1 << 24]),
    st.sampled_from([None, None, None, "", "another-deployment"]),
)


@st.composite
def tensor_refs(draw: Any) -> tuple[dict[str, Any], list[bytes]]:
    """Frame refs and frames, consistent or not; pool refs as ``ShmSpec``s."""
    refs: dict[str, Any] = {}
    frames: list[bytes] = []
    for i in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        name = draw(st.sampled_from(["x", "x", "x", "y", f"t{i}", ""]))
        if draw(st.sampled_from(range(3))) == 0:
            refs[name] = draw(shm_specs)
            continue
        dtype, shape = draw(dtypes), draw(shapes)
        if draw(st.booleans()) and dtype in ITEMSIZE and all(0 <= d <= 64 for d in shape):
            data = b"\x01" * (math.prod(shape) * ITEMSIZE[dtype])  # a consistent frame
        else:
            data = draw(st.binary(max_size=64))
        frames.append(data)
        index = draw(st.sampled_from([len(frames)] * 6 + [len(frames) + 1, 0, -1, 7, 2**40]))
        refs[name] = {"type": "frame", "index": index, "dtype": dtype, "shape": shape}
    if draw(st.sampled_from(range(5))) == 0:
        frames += draw(st.lists(st.binary(max_size=8), min_size=1, max_size=2))  # stray
    if frames and draw(st.sampled_from(range(6))) == 0:
        frames.pop(draw(st.integers(0, len(frames) - 1)))  # a missing one
    return refs, frames


FRESH, REPLAY = "\0fresh", "\0replay"
TOKEN = b"fuzz-token-01234"  # a well-formed Call's request token (16 bytes)
# A Call's fields after ``tensors`` at their defaults (params .. trace), then its token: what
# a well-formed input sends, so that the actor judges its tensors, not its missing token.
_CALL_REST = [{}, 0, True, 0, 0.0, "", "", None, [], {}, 0, {}, "", TOKEN]


@dataclass
class WireInput:
    header: Any  # bytes (sent as is) or a list (msgpack-encoded at check time)
    tensors: dict[str, Any]
    frames: list[bytes]


@st.composite
def wire_inputs(draw: Any) -> WireInput:
    """Four in ten headers are malformed; the rest are well-formed Calls whose tensors,
    frames, pool refs and request ids (replays included) are what is hostile."""
    refs, frames = draw(tensor_refs())
    # FRESH: a new id at check time; REPLAY: the id of the input before; or any text
    rid = draw(st.sampled_from([FRESH] * 6 + [REPLAY]) | st.text(max_size=8))
    data = draw(st.dictionaries(st.text(max_size=8), values, max_size=3))
    fields: list[Any] = ["call", rid, "check", None, data, None]
    # hypothesis favours the simplest choice (the first): make that a well-formed Call
    kind = draw(st.sampled_from(range(10)))
    if kind == 6:  # bytes that may not be msgpack at all, or a torn header
        return WireInput(draw(st.binary(max_size=200)), refs, frames)
    if kind == 7:  # an unknown tag or another message type
        fields[0] = draw(st.sampled_from(["exec", "pickle", "emit", "done", "reg_put", "hello"]))
    if kind == 8:  # wrong types in the known fields, and in the ones after them
        for i in range(1, 5):
            if draw(st.booleans()):
                fields[i] = draw(values)
        fields += draw(st.lists(values, max_size=3))
    if kind == 9:  # a truncated or overlong header
        fields = fields[: draw(st.integers(0, 4))] or fields + [0] * 20
    if kind < 6:
        fields += _CALL_REST
    return WireInput(fields, refs, frames)


class WireChecker:
    """Sends ``WireInput``s to a live actor and judges each answer."""

    def __init__(self, live: Any, probe: Any, tally: Tally) -> None:
        self.live, self.probe, self.tally = live, probe, tally
        self.pid = live.replica.proc.pid
        self._ids = 0

    def _shm(self, spec: ShmSpec, leases: list[int]) -> dict[str, Any]:
        import torch

        pool = self.live.pool
        t, lease = pool.empty((16,), torch.float32)
        ref = pool.share(t, os.getpid() if spec.kind == "unshared" else received(self.pid))
        lease.release()
        if spec.kind == "stale":
            pool.release(ref.lease, received(self.pid))
        else:
            leases.append(ref.lease)
        out = msgspec.to_builtins(ref)
        out["type"] = "shm"
        out.update(dtype=spec.dtype, shape=spec.shape)
        out["offset"] = ref.offset + spec.offset_delta
        out["lease"] = ref.lease + spec.lease_delta if spec.kind != "random" else spec.lease_delta
        if spec.pool is not None:
            out["pool"] = spec.pool
        return out

    def check(self, item: WireInput) -> None:
        self.tally.tried["wire"] += 1
        leases: list[int] = []
        header = item.header
        if isinstance(header, list):
            header = list(header)
            if len(header) > 1 and header[1] in (FRESH, REPLAY):
                self._ids += header[1] == FRESH
                header[1] = f"fz-{id(self):x}-{self._ids}"
            if len(header) > 3 and header[3] is None:
                header[3] = self.probe.reply_to
            if len(header) > 5 and header[5] is None:
                header[5] = {
                    k: self._shm(v, leases) if isinstance(v, ShmSpec) else v
                    for k, v in item.tensors.items()
                }
            header = msgspec.msgpack.encode(header)
        try:
            self._judge(header, item.frames)
        finally:
            for lease in leases:  # refs made for this input that the actor never took
                holders = self.live.pool.holders(lease) if self.live.pool.refs(lease) else {}
                for pid, n in holders.items():
                    self.live.pool.release(lease, pid, n)

    def _judge(self, header: bytes, frames: list[bytes]) -> None:
        try:
            msg = decode(header)
        except BadMessage:
            msg = None
        if isinstance(msg, Call) and (
            msg.reply_to != self.probe.reply_to or msg.seq or not msg.last or msg.join
        ):
            # An answer goes elsewhere, or the request waits for more: cancel it.
            self.probe.send([header, *frames])
            self.probe.send([encode(Cancel(msg.request_id, token=msg.token))])
            return
        self.probe.send([header, *frames])
        if isinstance(msg, Cancel):
            return  # a Cancel is never answered
        rid = msg.request_id if isinstance(msg, Call) else ""
        reply = self.probe.reply_for(rid, REPLY_TIMEOUT)
        if reply is None:
            self.tally.unclear_error("wire", f"no answer to {header[:80]!r}")
        elif isinstance(reply, Fail):
            if reply.code not in CODES or not reply.message:
                self.tally.unclear_error("wire", f"{reply}")
        elif not isinstance(reply, Done):
            self.tally.unclear_error("wire", f"answered with {reply}")


# ------------------------------------------------------------------ HTTP

CHAT = "/v1/chat/completions"
message_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "video", 3])},
    optional={
        "text": values,
        "image_url": st.fixed_dictionaries({"url": st.text(max_size=40) | values}) | values,
        "input_audio": st.fixed_dictionaries({"data": st.text(max_size=40), "format": values}),
    },
)
chat_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | values},
                optional={"content": st.text(max_size=20) | st.lists(message_parts, max_size=3)},
            ),
            max_size=3,
        )
        | values,
        "stream": values,
        "max_tokens": st.integers(-5, 2**70) | values,
        "temperature": st.floats() | values,
        "n": values,
        "modalities": values,
    },
)


@st.composite
def http_inputs(draw: Any) -> tuple[str, bytes, dict[str, str]]:
    path = draw(st.sampled_from([CHAT, CHAT, "/v1/images/generations", "/v1/models", "/nope"]))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        body = draw(st.binary(max_size=200))  # not JSON, or not UTF-8
    elif kind == 1:
        text = json.dumps(draw(chat_bodies), default=repr, allow_nan=True)
        body = text[: draw(st.integers(0, len(text)))].encode()  # cut short
    elif kind == 2:
        body = b'{"model": "x", "messages": [' + b"[" * draw(st.integers(1, 200_000))
    else:
        body = json.dumps(draw(chat_bodies), default=repr).encode()
    headers = {"content-type": draw(st.sampled_from(["application/json", "text/plain", ""]))}
    return path, body, headers


def check_http(client: httpx.Client, url: str, item: Any, tally: Tally, key: str = "") -> None:
    """4xx with an error body naming what is wrong, or 200: never a 5xx or a dropped socket."""
    tally.tried["http"] += 1
    path, body, headers = item
    if key:
        headers = {**headers, "authorization": f"Bearer {key}"}
    try:
        r = client.post(url + path, content=body, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        tally.unclear_error("http", f"{type(e).__name__} for {body[:80]!r}")
        return
    if r.status_code == 200:
        return
    try:
        error = r.json()["error"]
        clear = 400 <= r.status_code < 500 and bool(error["message"])
    except (ValueError, KeyError, TypeError):
        clear = False
    if not clear:
        tally.unclear_error("http", f"{r.status_code} {r.text[:200]} for {body[:80]!r}")


# ------------------------------------------------------------------ configs

config_keys = st.sampled_from(
    ["name", "roles", "graph", "runtime", "cache", "gateway", "resources", "security", "x"]
)
config_values = values | st.dictionaries(st.text(max_size=10), values, max_size=4)
good_toml = """name = "t"
[roles.upper]
actor = "omniflow.roles.echo:Upper"
[graph]
edges = [{ from = "input", to = "upper" }]
[runtime]
transport = "ipc"
heartbeat_s = 0.5
"""


@st.composite
def config_inputs(draw: Any) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:  # the good config with bytes flipped or cut
        raw = bytearray(good_toml.encode())
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw[: draw(st.integers(0, len(raw)))])
    lines = good_toml.splitlines()
    at = draw(st.integers(0, len(lines)))
    key = draw(st.sampled_from(["name", "actor", "transport", "bind_host", "heartbeat_s", "to"]))
    value = draw(
        st.sampled_from(['"0.0.0.0"', "-1", "1e999", '"tcp"', "[1,2]", "{}", '""', "true"])
    )
    return "\n".join([*lines[:at], f"{key} = {value}", *lines[at:]]).encode()


def check_config(path: Any, raw: bytes, tally: Tally) -> None:
    from omniflow.runtime.config import ConfigError, load

    tally.tried["config"] += 1
    path.write_bytes(raw)
    try:
        load(path)
    except ConfigError as e:
        if not str(e).startswith(str(path)):
            tally.unclear_error("config", f"{e} (does not name the file)")
    except Exception as e:  # anything else escaped the loader
        tally.unclear_error("config", f"{type(e).__name__}: {e} for {raw[:80]!r}")


# ------------------------------------------------------------------ media


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


def _jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(out, format="JPEG")
    return out.getvalue()


def _wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x01\x02" * 64)
    return out.getvalue()


SEEDS = {"png": _png(), "jpeg": _jpeg(), "wav": _wav()}


@st.composite
def media_inputs(draw: Any) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(sorted(SEEDS)))
    raw = bytearray(SEEDS[kind])
    how = draw(st.integers(0, 3))
    if how == 0:
        return kind, draw(st.binary(max_size=300))
    if how == 1:
        return kind, bytes(raw[: draw(st.integers(0, len(raw)))])
    for _ in range(draw(st.integers(1, 8))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return kind, bytes(raw)


class MediaChecker:
    """The gateway-side decoders of image and audio bytes, as the roles run them."""

    def __init__(self) -> None:
        from omniflow.roles.vision_encoder import VisionEncoderRole

        self.image = VisionEncoderRole.__new__(VisionEncoderRole)  # _decode needs only the limit
        self.image.max_image_pixels = 1 << 20

    def check(self, item: tuple[str, bytes], tally: Tally) -> None:
        from omniflow.roles.audio_encoder import read_wav
        from omniflow.runtime.actor import BadRequest

        tally.tried["media"] += 1
        kind, data = item
        try:
            if kind == "wav":
                read_wav(data, (16000, 24000))
            else:
                self.image._decode(data)
        except BadRequest as e:
            if not str(e).startswith(("audio:", "image:")):
                tally.unclear_error("media", f"{e}")
        except Exception as e:
            tally.unclear_error("media", f"{kind}: {type(e).__name__}: {e} for {data[:60]!r}")


def run_for(seconds: float, strategy: Any, check: Any, chunk: int = 25) -> None:
    """Draw from ``strategy`` and ``check`` each input until ``seconds`` have passed."""
    from hypothesis import HealthCheck, Phase, given, settings

    end = time.monotonic() + seconds

    @settings(
        max_examples=chunk,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def chunk_of(item: Any) -> None:
        if time.monotonic() < end:
            check(item)

    while time.monotonic() < end:
        chunk_of()
