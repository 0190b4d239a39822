"""Incremental detokenization: the streamed pieces add up to the one-shot decode."""

import pytest

from omniflow.models import load_tokenizer
from omniflow.models.tiny.tokenizer import build_tiny_tokenizer, save_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(build_tiny_tokenizer(512), folder)
    return load_tokenizer(folder)


@pytest.mark.parametrize(
    "text", ["plain words, the quick brown fox", "héllo wörld 日本語 ✓ 🦊 done", "🦊🦊"]
)
def test_streamed_text_equals_the_one_shot_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    for ends in (len(ids), len(ids) - 1):  # also ending mid-character
        stream = tokenizer.stream()
        pieces = [stream.push([token]) for token in ids[:ends]]
        pieces.append(stream.finish())
        assert "".join(pieces) == tokenizer.decode(ids[:ends])
        assert "\ufffd" not in "".join(pieces[:-1])  # never a half character mid-stream


def test_pushing_several_tokens_at_once(tokenizer):
    ids = tokenizer.encode("a 日本 b", add_special_tokens=False)
    stream = tokenizer.stream()
    text = stream.push(ids[:3]) + stream.push(ids[3:]) + stream.finish()
    assert text == tokenizer.decode(ids)
