"""Logprob entries join to the reply's text, special tokens included (they decode to
nothing there, so they must decode to nothing here too)."""

from __future__ import annotations

from types import SimpleNamespace

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from omniflow.models.text_tokenizer import TextTokenizer
from omniflow.roles.llm_prompt import token_logprobs


def test_the_entries_join_to_the_streamed_text_when_a_special_token_is_sampled() -> None:
    raw = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.Fuse()  # tokens carry their own spacing, as byte-level BPE's do
    raw.add_special_tokens([AddedToken("<longcat_reserved_7>", special=True)])
    tok = TextTokenizer(raw)
    special = raw.token_to_id("<longcat_reserved_7>")
    ids = [0, special, 1]
    stream = tok.stream()
    text = "".join(stream.push([i]) for i in ids) + stream.finish()
    delta = SimpleNamespace(
        token_ids=ids, logprobs=[-0.1, -0.2, -0.3], top_logprobs=[{special: -0.2, 0: -0.5}] * 3
    )
    entries = token_logprobs(tok, delta)
    assert "".join(e["token"] for e in entries) == text
    assert entries[1]["token"] == ""  # the sampled special is not in the text
    assert entries[0]["top_logprobs"][0]["token"] == "<longcat_reserved_7>"  # alternatives name it


def test_bytes_are_each_tokens_own_even_mid_character() -> None:
    """A byte-level BPE splits "é" (C3 A9) into two tokens; each decodes alone to U+FFFD,
    but its logprob ``bytes`` are its own byte, so the entries' bytes join to the text."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken("<s>", special=True)])
    tok = TextTokenizer(raw)
    ids = tok.encode("aé", add_special_tokens=False)
    assert len(ids) == 3 and tok.decode([ids[1]]) == "\ufffd"
    special = raw.token_to_id("<s>")
    delta = SimpleNamespace(
        token_ids=ids, logprobs=[-0.1] * 3, top_logprobs=[{special: -0.3, ids[2]: -0.4}] * 3
    )
    entries = token_logprobs(tok, delta)
    assert [e["bytes"] for e in entries] == [[0x61], [0xC3], [0xA9]]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "aé"
    tops = entries[0]["top_logprobs"]
    assert tops[0]["bytes"] == list(b"<s>") and tops[1]["bytes"] == [0xA9]


def test_byte_fallback_pieces_are_their_byte() -> None:
    """A SentencePiece-style ``<0xE2>`` piece stands for that byte."""
    raw = Tokenizer(models.WordLevel({"<0xE2>": 0, "hi": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.decoder = decoders.ByteFallback()
    tok = TextTokenizer(raw)
    assert tok.token_bytes(0) == b"\xe2" and tok.token_bytes(1) == b"hi"
