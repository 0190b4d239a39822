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
