"""Where a tensor's bytes live, read from the kernel's own account: /proc/<pid>/maps.

Two processes share memory exactly when their addresses resolve to the same file and
offset; this is how tests (and a curious operator) prove that shared weights are shared,
without trusting a flag the code under test sets. Usage::

    where = mapping_of(model.model.embed_tokens.weight)    # this process
    where.path, where.offset    # '/dev/shm/omniflow-demo', 2162688
    mapping_at(address, pid=worker_pid)                    # another process's address

Linux only (/proc); a pid of another user needs the rights ptrace would.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

_DELETED = " (deleted)"


class Mapping(NamedTuple):
    path: str  # the mapped file, or '' for anonymous memory ('[heap]' and such for the rest)
    offset: int  # of the address in that file (in the anonymous region: from its start)
    deleted: bool  # the file was unlinked since it was mapped (the pages stay shared)


def mapping_at(address: int, pid: int | None = None) -> Mapping:
    """The mapping of ``pid`` (default: this process) holding ``address``; ``LookupError``
    when the address is not mapped there."""
    where = f"/proc/{pid or os.getpid()}/maps"
    with open(where) as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                path = fields[5].rstrip("\n") if len(fields) > 5 else ""
                deleted = path.endswith(_DELETED)
                if deleted:
                    path = path[: -len(_DELETED)]
                return Mapping(path, int(fields[2], 16) + address - lo, deleted)
    raise LookupError(f"address {address:#x} is not mapped in {where}")


def address_of(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s first element (also for an empty tensor, unlike data_ptr)."""
    offset = int(tensor.storage_offset()) * tensor.element_size()
    return int(tensor.untyped_storage().data_ptr()) + offset


def mapping_of(tensor: torch.Tensor) -> Mapping:
    """The mapping of this process that ``tensor``'s first element lies in (a CPU tensor)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor: on {tensor.device}; /proc maps describe host memory only")
    return mapping_at(address_of(tensor))
