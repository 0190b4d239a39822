"""A thin wrapper over a `tokenizers.Tokenizer` loaded from tokenizer.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the rest for U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


_UNICODE_TO_BYTE = _byte_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._byte_level: bool | None = None  # whether its decoder is byte-level (lazy)

    @classmethod
    def from_folder(cls, path: str | Path) -> TextTokenizer:
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model folder {folder}")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        return cls(tokenizer, _eos_token_ids(folder, tokenizer))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The raw bytes a token stands for (OpenAI's logprob ``bytes``): for a byte-level
        BPE token that ends mid-character, its bytes, not the replacement character its
        text alone decodes to; ``<0xHH>`` byte-fallback pieces as their byte; a skipped
        special token none."""
        text = self.decode([token_id], skip_special_tokens)
        if not text:
            return b""
        piece = self.tokenizer.id_to_token(token_id) or ""
        if self._byte_level is None:  # once: the decoder from the tokenizer's JSON
            decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
            parts = decoder.get("decoders") or [decoder]
            self._byte_level = any(p.get("type") == "ByteLevel" for p in parts if p)
        if self._byte_level and piece and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match[1], 16)])
        return text.encode()

    def stream(self, skip_special_tokens: bool = True) -> TextStream:
        """An incremental decoder for one generated sequence (`TextStream`)."""
        return TextStream(self.tokenizer, skip_special_tokens)


class TextStream:
    """Text of a growing token sequence, delta by delta, at a cost per new token (not per
    token so far): `tokenizers`' DecodeStream, which holds back a byte-level token that ends
    mid-character until the character is complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""  # what push and finish returned so far

    def push(self, token_ids: list[int]) -> str:
        """The text the new tokens complete (empty while a character is still partial)."""
        pieces = []
        for token_id in token_ids:
            self.token_ids.append(token_id)
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                pieces.append(piece)
        new = "".join(pieces)
        self.text += new
        return new

    def finish(self) -> str:
        """At the end: the rest of the one-shot decode of all the tokens (bytes of a
        character that never completed, as U+FFFD), so the pieces add up to it. One full
        decode per sequence."""
        full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        return rest


def _eos_token_ids(folder: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        eos_token = json.loads(config_file.read_text()).get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if token_id is not None:
            return (token_id,)
    return ()
