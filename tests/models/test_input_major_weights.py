"""Input-major weights change only the memory layout: same names, shapes, values, logits,
and checkpoints still load into them."""

import os

import torch

from omniflow.models import build_tiny_model, load_decoder
from omniflow.models.loader import iter_checkpoint_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def causal_attention(layer_index, q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)


def logits(model, token_ids):
    with torch.inference_mode():
        return model(torch.tensor(token_ids), torch.arange(len(token_ids)), causal_attention)


def test_input_major_weights_keep_values_and_reload(tmp_path):
    path = build_tiny_model(tmp_path / "m", "qwen2-tied-odd-heads", seed=3)
    model = load_decoder(path, device="cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = logits(model, [5, 9, 2, 7, 11])
    model.use_input_major_weights()
    projections = [
        p
        for name, p in model.named_parameters()
        if name.endswith(("proj.weight", "embed_tokens.weight"))
    ]
    assert projections and all(p.t().is_contiguous() for p in projections)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    # A different GEMM kernel may round differently: equal up to float32 noise.
    torch.testing.assert_close(logits(model, [5, 9, 2, 7, 11]), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    model.load_weights(iter_checkpoint_tensors(path))  # shard views of strided parameters
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
