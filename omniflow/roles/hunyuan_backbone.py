"""The HunyuanImage-3 backbone as the ``ar`` and ``diffusion`` roles hold it: one copy.

The first of the two processes to load copies the backbone's tensors into the deployment's
host page pool; the other maps the same pages (memory/weights.py). ``where()`` says which
shared file and offset they lie in, read from /proc/self/maps (published in the replica's
registry record, so a test or an operator can compare the two processes' mappings).

``build_tiny``: the three roles of a deployment start at once and build one folder; a lock
file next to it lets one build while the others wait.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from omniflow.engine import EmbeddingSpan
from omniflow.memory import PagePool
from omniflow.memory.mappings import address_of, mapping_of
from omniflow.memory.weights import SharedWeights
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts, load_image_parts
from omniflow.models.loader import load_decoder, load_tokenizer
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3
from omniflow.roles.options import BackboneOptions, WeightsOptions
from omniflow.runtime.actor import BadRequest, Request

_WEIGHTS = ("model.safetensors.index.json", "model.safetensors")


def ensure_tiny(path: str | Path, seed: int) -> None:
    """Build the tiny model in ``path`` unless it is there (one builder at a time)."""
    folder = Path(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the kernel drops it if the builder dies
        if not any((folder / name).is_file() for name in _WEIGHTS):  # written last
            build_tiny_hunyuan_image3(folder, seed)


@contextmanager
def loading(role: str, folder: str | Path) -> Iterator[None]:
    """A checkpoint that does not fit (a tensor missing, extra, renamed or mis-shaped) fails
    the role's start with the tensor, the role and the folder named."""
    try:
        yield
    except (ValueError, KeyError, RuntimeError) as exc:
        where = Path(folder)
        raise ValueError(
            f"role {role!r}: model_path {str(where)!r} ({where.resolve()}): {exc}"
        ) from exc


def image_parts(
    opts: WeightsOptions, role: str = "vae_decoder", decoder_only: bool = False
) -> HunyuanImage3Parts:
    """The image parts a role reads from its folder (decoder_only: vae.decoder.* alone)."""
    if opts.build_tiny:
        ensure_tiny(opts.model_path, opts.seed)
    with loading(role, opts.model_path):
        return load_image_parts(opts.model_path, opts.device, decoder_only=decoder_only)


@dataclass
class Backbone:
    model: Any  # HunyuanImage3LM, its tensors views of the pool (or private without one)
    tokenizer: Any
    parts: HunyuanImage3Parts
    weights: SharedWeights | None

    @property
    def config(self) -> Any:
        return self.model.config

    @classmethod
    def load(cls, opts: BackboneOptions, pool: PagePool | None, role: str = "") -> Backbone:
        parts = image_parts(opts, role)
        path = Path(opts.model_path)
        shared = pool is not None and opts.device == "cpu" and opts.share_weights
        weights = SharedWeights(pool, path) if shared and pool is not None else None
        place = None if weights is None else cast(Any, weights.place)  # a WeightPlacer
        try:
            with loading(role, path):
                model = load_decoder(path, opts.device, place=place)
        except BaseException:
            if weights is not None:
                weights.close()
            raise
        return cls(model, load_tokenizer(path), parts, weights)

    def where(self) -> dict[str, Any]:
        """Where the backbone's tensors lie in this process: each one's [address, bytes] (a
        test or an operator resolves them in /proc/<pid>/maps), the first one's mapping as
        this process sees it, the total bytes, and whether this process loaded the copy."""
        tensors = [t for t in self.model.parameters() if t.numel()]
        found = mapping_of(tensors[0])
        return {
            "tensors": [[address_of(t), t.numel() * t.element_size()] for t in tensors],
            "path": found.path,
            "offset": found.offset,
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "loaded": self.weights is None or self.weights.created,
        }

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
            self.weights = None


def span_fields(spans: list[EmbeddingSpan]) -> dict[str, Any]:
    """A context's embedding spans (a condition image's rows) as output fields, for a
    diffusion role that computes the context itself: starts and keys in ``condition``, the
    rows (and 2D positions) as tensors."""
    out: dict[str, Any] = {"condition": []}
    for i, span in enumerate(spans):
        key = span.content_hash  # (kind, image hash): condition_image_prompt's spans
        assert isinstance(key, tuple), f"span at {span.start}: expected a (kind, hash) key"
        out["condition"].append({"start": span.start, "key": list(key)})
        out[f"condition_rows{i}"] = span.embeddings
        if span.positions is not None:
            out[f"condition_positions{i}"] = span.positions
    return out


def spans_of(request: Request) -> list[EmbeddingSpan]:
    """The spans ``span_fields`` sent, as the request brings them."""
    spans = []
    for i, entry in enumerate(request.get("condition") or []):
        rows = request.get(f"condition_rows{i}")
        if not isinstance(entry, dict) or not isinstance(rows, torch.Tensor):
            raise BadRequest("condition", f"entry {i}: expected a start, a key and its rows")
        positions = request.get(f"condition_positions{i}")
        start, key = entry.get("start"), entry.get("key")
        if not isinstance(start, int) or not isinstance(key, list):
            raise BadRequest("condition", f"entry {i}: expected a start and a key")
        spans.append(EmbeddingSpan(start, rows, tuple(key), positions))
    return spans
