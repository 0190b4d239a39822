"""One copy of a model's weights per host, in the deployment's page pool, for every local
process that loads the same checkpoint (the ``ar`` and ``diffusion`` roles of one backbone).

The first process to load a checkpoint copies its tensors once into one pool block and
publishes a manifest next to the pool segment; every later one finds the manifest and maps
the same block: views of pool memory, no second copy, no disk read. Usage::

    weights = SharedWeights(pool, "models/tiny", prefix="model.")   # the backbone only
    model = load_decoder("models/tiny", place=weights.place)        # params: pool views
    ...
    weights.close()   # this process's ref; the last holder's close frees the block

    # or a state dict of the checkpoint's own tensors, no model:
    tensors = share_checkpoint(pool, "models/tiny", prefix="model.").tensors

Keys. A manifest is found by a hash of the checkpoint (its folder, and each file's name,
size, mtime and inode), the prefix, a caller's tag and every tensor's name, dtype, shape and
strides, so a rewritten checkpoint, another dtype or another layout is another copy, never a
stale one. Its block carries a tag from the same hash (``PagePool.alloc(tag=)``), checked
before use, so a manifest left by a crashed run cannot name an unrelated block.

Races. A per-key lock file (flock: the kernel drops it when its holder dies) covers
find-or-load, so two processes starting at once load once. A loader killed mid-copy leaves
no manifest; its block is reclaimed with its pid, and the next process loads afresh.

Lifetime. Each process holds one ref per load, attributed to its pid: ``close()`` drops it,
and the supervisor's ``reclaim`` drops a dead one's. When the last ref goes, the block
returns to the pool and the closer removes the manifest. Views stay readable after
``close`` but their pages may be reused: close only once the model is done. Nothing is
written through the views after loading; the mapping is writable, so that is by contract.

Host memory only: a GPU model is not placed in the pool (the one-copy design there is CUDA
IPC from one process to the other, cuda_ipc.py; not built here).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from omniflow.memory.dtypes import ITEMSIZE, dtype_name, torch_dtype
from omniflow.memory.errors import InvalidHandle
from omniflow.memory.pool import PagePool
from omniflow.memory.segment import side_file

_ALIGN = 64  # each tensor's first byte: a cache line, and every dtype's alignment
_FORMAT = 1  # bump when the manifest or the block layout changes

# fill(select): load the checkpoint's tensors whose names pass select (None: all of them)
# into the module as it now stands, and fail if any of those is missing.
Fill = Callable[[Callable[[str], bool] | None], None]


class TensorSpec(NamedTuple):
    name: str
    dtype: str  # a wire dtype name (omniflow.memory.dtypes)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0  # bytes from the block's start, set by the layout

    @property
    def extent(self) -> int:
        """Bytes from the first element to one past the last (strides included)."""
        if any(d == 0 for d in self.shape):
            return 0
        last = sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True))
        return (last + 1) * ITEMSIZE[self.dtype]


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()))


def checkpoint_fingerprint(source: str | Path) -> list[object]:
    """What identifies a checkpoint on disk: its resolved folder and, per weight or config
    file, name, size, mtime and inode (a rewrite by rename changes the inode)."""
    path = Path(source).resolve()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"source: no checkpoint at {source}")
    stats = [(f.name, (st := f.stat()).st_size, st.st_mtime_ns, st.st_ino) for f in files]
    return [str(path), stats]


class SharedWeights:
    """This process's hold on one shared copy of (part of) a checkpoint's tensors.

    ``prefix``: share only tensors whose names start with it (or one of them); the others
    stay private to each process. ``tag``: anything else that makes two loads differ.
    """

    def __init__(
        self,
        pool: PagePool,
        source: str | Path,
        *,
        prefix: str | tuple[str, ...] = "",
        tag: str = "",
    ) -> None:
        self.pool = pool
        self.source = Path(source)
        self.prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
        self.tag = tag
        self.key = ""
        self.lease: int | None = None
        self.nbytes = 0
        self.created = False  # this process loaded the copy (the others mapped it)
        self.tensors: dict[str, torch.Tensor] = {}

    def shares(self, name: str) -> bool:
        return name.startswith(self.prefixes)

    # ------------------------------------------------------------ loading

    def place(self, module: nn.Module, fill: Fill) -> None:
        """The loader's hook (``load_decoder(place=...)``): make ``module``'s shared parameters
        and buffers views of the pool copy, keeping each one's dtype, shape and strides (the
        run-time layout the loader chose), then load what is not already there."""
        owners = _tensor_owners(module)
        specs = [spec_of(name, t) for name, (t, _) in owners.items() if self.shares(name)]
        if not specs:
            raise ValueError(f"prefix: {self.prefixes} matches no tensor of the model")

        def fill_pool(views: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():  # buffers keep the values the model was built with
                for name, view in views.items():
                    tensor, _ = owners[name]
                    if not isinstance(tensor, nn.Parameter):
                        view.copy_(tensor)
            _bind(owners, views)
            fill(None)

        views = self.load(specs, fill_pool)
        if not self.created:
            _bind(owners, views)
            if len(views) < len(owners):
                try:
                    fill(lambda name: not self.shares(name))
                except BaseException:
                    self.close()
                    raise

    def load(
        self, specs: Iterable[TensorSpec], fill: Callable[[dict[str, torch.Tensor]], None]
    ) -> dict[str, torch.Tensor]:
        """Views of the shared copy of tensors ``specs`` (offsets are assigned here): mapped
        when published already, else allocated, written by ``fill(views)`` and published."""
        if self.lease is not None:
            raise RuntimeError(f"shared weights of {self.source}: already loaded; close first")
        layout, nbytes = _layout(specs)
        self.key = self._key(layout)
        manifest = Path(side_file(self.pool.path, f"weights-{self.key}.json"))
        tag = int(self.key[:15], 16)  # 60 bits: fits the table's int64
        with _file_lock(manifest.with_suffix(".lock")):
            lease = self._attach(manifest, layout, nbytes, tag)
            if lease is None:
                block = self.pool.alloc(nbytes, tag=tag)
                try:
                    views = self._views(block.id, layout)
                    fill(views)
                    _publish(manifest, self.key, block.id, nbytes, layout)
                except BaseException:
                    block.release()
                    raise
                lease, self.created = block.id, True
            else:
                views = self._views(lease, layout)
        self.lease, self.nbytes, self.tensors = lease, nbytes, views
        return views

    def _key(self, layout: list[TensorSpec]) -> str:
        what = [_FORMAT, checkpoint_fingerprint(self.source), self.prefixes, self.tag]
        what.append([spec[:4] for spec in layout])
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]

    def _attach(
        self, manifest: Path, layout: list[TensorSpec], nbytes: int, tag: int
    ) -> int | None:
        """The lease the manifest names, now with a ref for this pid; None when there is no
        manifest or it names a block that is gone or not these tensors (a stale one)."""
        try:
            found = json.loads(manifest.read_text())
            lease = int(found["lease"])
            if found["key"] != self.key or found["nbytes"] != nbytes:
                return None
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        try:
            self.pool.retain(lease)
        except InvalidHandle:  # freed since: the last holder died and was reclaimed
            return None
        if self.pool.tag(lease) != (nbytes, tag):
            self.pool.release(lease)
            return None
        return lease

    def _views(self, lease: int, layout: list[TensorSpec]) -> dict[str, torch.Tensor]:
        with torch.inference_mode(False):  # views writable (and loadable) outside it too
            block = self.pool.block_bytes(lease)
            views = {}
            for spec in layout:
                raw = block[spec.offset : spec.offset + spec.extent].view(torch_dtype(spec.dtype))
                views[spec.name] = raw.as_strided(spec.shape, spec.stride)
        return views

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Drop this process's ref; the last holder's close frees the block."""
        lease, self.lease, self.tensors = self.lease, None, {}
        if lease is None:
            return
        manifest = Path(side_file(self.pool.path, f"weights-{self.key}.json"))
        with _file_lock(manifest.with_suffix(".lock")):
            try:
                freed = self.pool.release(lease)
            except InvalidHandle:  # reclaimed under us (the supervisor took this pid for dead)
                freed = True
            if freed and _published_lease(manifest) == lease:
                manifest.unlink(missing_ok=True)

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"lease={self.lease}" if self.lease is not None else "closed"
        return f"SharedWeights({str(self.source)!r}, {len(self.tensors)} tensors, {state})"


def share_checkpoint(
    pool: PagePool,
    source: str | Path,
    *,
    prefix: str | tuple[str, ...] = "",
    dtype: torch.dtype | None = None,
) -> SharedWeights:
    """The safetensors tensors of ``source`` (a file, or a folder of shards) whose names start
    with ``prefix``, as one shared copy in ``pool`` (cast to ``dtype`` if given): a state
    dict in ``.tensors``, in the checkpoint's own names and shapes."""
    weights = SharedWeights(pool, source, prefix=prefix, tag=f"checkpoint:{dtype}")
    specs = []
    for shard, name in _checkpoint_tensors(weights.source):
        if weights.shares(name):
            part = shard.get_slice(name)
            shape = tuple(part.get_shape())
            kind = dtype or _SAFETENSORS_DTYPES.get(part.get_dtype())
            if kind is None:
                raise ValueError(f"{source}: tensor {name!r} has dtype {part.get_dtype()}")
            specs.append(TensorSpec(name, dtype_name(kind), shape, _contiguous(shape)))
    if not specs:
        raise ValueError(f"prefix: {weights.prefixes} matches no tensor in {source}")

    def fill(views: dict[str, torch.Tensor]) -> None:
        for shard, name in _checkpoint_tensors(weights.source):
            if name in views:
                views[name].copy_(shard.get_tensor(name))

    weights.load(specs, fill)
    return weights


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


_INDEX = "model.safetensors.index.json"  # Hugging Face's shard index (what the loader reads)


def _checkpoint_tensors(source: Path) -> Iterator[tuple[Any, str]]:
    """(open shard, tensor name) for every tensor of a safetensors file or folder of shards."""
    for file in _shard_files(source):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                yield shard, name


def _shard_files(source: Path) -> list[Path]:
    """A checkpoint's safetensors files: the shards its index names (a stray file beside
    them is not the model's), else the folder's files, or ``source`` itself. Read here, not
    through the models layer, which the cache layer must not import."""
    if not source.is_dir():
        if not source.is_file():
            raise FileNotFoundError(f"source: no checkpoint at {source}")
        return [source]
    index = source / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [source / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"source: {index} is not a safetensors index: {e!r}") from None
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"source: {index} names shards that are absent: {missing}")
    else:
        files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"source: no *.safetensors in {source}")
    return files


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _layout(specs: Iterable[TensorSpec]) -> tuple[list[TensorSpec], int]:
    """Offsets for ``specs`` in one block, in the given order; and the block's size."""
    layout, at = [], 0
    for spec in specs:
        layout.append(spec._replace(offset=at))
        at += -(-spec.extent // _ALIGN) * _ALIGN
    return layout, max(at, _ALIGN)


def _tensor_owners(module: nn.Module) -> dict[str, tuple[torch.Tensor, list[tuple]]]:
    """Every parameter and buffer of ``module`` by its first name, with each (module, kind,
    attribute) slot holding it: a tied tensor is bound to one view in all its slots."""
    owners: dict[str, tuple[torch.Tensor, list[tuple]]] = {}
    by_id: dict[int, str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(sub, kind).items():
                if tensor is None:
                    continue
                name = by_id.setdefault(id(tensor), f"{prefix}.{attr}" if prefix else attr)
                owners.setdefault(name, (tensor, []))[1].append((sub, kind, attr))
    return owners


def _bind(
    owners: dict[str, tuple[torch.Tensor, list[tuple]]], views: dict[str, torch.Tensor]
) -> None:
    for name, view in views.items():
        tensor, slots = owners[name]
        if isinstance(tensor, nn.Parameter):
            view = nn.Parameter(view, requires_grad=False)
        for sub, kind, attr in slots:
            getattr(sub, kind)[attr] = view


def _publish(manifest: Path, key: str, lease: int, nbytes: int, layout: list[TensorSpec]) -> None:
    """Write the manifest whole under a temporary name, then rename: readers see all or none."""
    body = {"key": key, "lease": lease, "nbytes": nbytes, "tensors": [list(s) for s in layout]}
    tmp = manifest.with_name(f"{manifest.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
    os.replace(tmp, manifest)


def _published_lease(manifest: Path) -> int | None:
    try:
        return int(json.loads(manifest.read_text())["lease"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the flock
