"""Greedy sampling's fast argmax picks exactly what torch.argmax picks: greedy equality with
transformers rests on it being the same choice, ties and NaN included."""

import torch

from omniflow.engine.sampler import greedy_tokens


def test_greedy_tokens_match_torch_argmax_including_ties_and_nan():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 8192, generator=generator)
    logits[3, [10, 20, 30]] = 50.0  # a tie: the first maximum wins, as in torch.argmax
    logits[5] = 0.0  # all equal
    logits[7, 100] = float("inf")
    logits[9, 200] = float("nan")  # NaN compares as the maximum in both
    chosen = greedy_tokens(logits)
    assert chosen.dtype == torch.long
    assert torch.equal(chosen, logits.argmax(-1))
    assert chosen[3] == 10 and chosen[5] == 0 and chosen[7] == 100 and chosen[9] == 200
    strided = logits[::2, 1:]  # a view, not contiguous
    assert torch.equal(greedy_tokens(strided), strided.argmax(-1))
    half = logits.to(torch.bfloat16)  # the torch path
    assert torch.equal(greedy_tokens(half), half.argmax(-1))
    with torch.inference_mode():
        assert torch.equal(greedy_tokens(logits.clone()), logits.argmax(-1))
