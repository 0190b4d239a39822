"""A LongCat role process imports only what its own part needs: the llm and the audio
decoder never load transformers, and the activations the flow decoder names match
transformers' ``ACT2FN`` without it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers.activations import ACT2FN

from omniflow.models.omni.next_flow_mel import _ACTIVATIONS, activation


@pytest.mark.parametrize("module", ["omniflow.roles.llm", "omniflow.roles.audio_decoder"])
def test_a_role_module_loads_no_transformers(module):
    code = f"import sys, {module}; print(sorted(m for m in ('transformers', 'diffusers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
def test_each_activation_is_transformers_own(name):
    x = torch.linspace(-6, 6, 257, dtype=torch.float64)
    torch.testing.assert_close(activation(name)(x), ACT2FN[name](x), rtol=0, atol=1e-12)


def test_another_name_falls_back_to_transformers():
    x = torch.linspace(-6, 6, 33, dtype=torch.float64)
    torch.testing.assert_close(activation("quick_gelu")(x), ACT2FN["quick_gelu"](x))
