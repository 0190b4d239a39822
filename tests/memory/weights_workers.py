"""Targets for worker processes in the shared weights tests (spawned: a real process each)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

from omniflow.memory import PagePool
from omniflow.memory.mappings import address_of
from omniflow.memory.weights import SharedWeights, TensorSpec
from omniflow.models.llama.decoder import causal_attention
from omniflow.models.loader import load_decoder

PROMPT = [1, 7, 42, 9, 300, 5, 77, 2]


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        return model(ids, torch.arange(len(PROMPT)), causal_attention)


def load_and_hold(pool_name: str, path: str, go: Any, conn: Any) -> None:
    """Wait for ``go`` (so that two workers load at once), load the model through the shared
    weights, report where each tensor lies and the logits; then close or idle on command."""
    torch.set_num_threads(1)
    pool = PagePool.attach(pool_name)
    go.wait()
    weights = SharedWeights(pool, path)
    model = load_decoder(path, dtype="float32", place=weights.place)
    addresses = {name: address_of(t) for name, t in model.state_dict(keep_vars=True).items()}
    conn.send((os.getpid(), addresses, logits_of(model).numpy(), weights.nbytes, weights.created))
    while (cmd := conn.recv()) != "exit":
        if cmd == "close":
            del model
            weights.close()
            conn.send("closed")


def die_while_loading(pool_name: str, path: str) -> None:
    """Allocate the shared block for ``path``'s tensors and die (kill -9) while filling it."""
    pool = PagePool.attach(pool_name)
    specs = [TensorSpec(f"t{i}", "float32", (1024,), (1,)) for i in range(4)]

    def fill(views: dict[str, torch.Tensor]) -> None:
        views["t0"].fill_(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    SharedWeights(pool, path, tag="die").load(specs, fill)
