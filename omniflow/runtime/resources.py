"""Co-location: roles sharing one device, and the barrier before they size memory.

Each co-located role loads its weights in ``setup()``, then waits at a registry
barrier until every replica of its group has done the same, and only then
measures free memory and receives its fraction through ``Actor.reserve``.
Without the barrier, the first role to start would size its KV pool against
memory its neighbours are about to fill with weights.
"""

from __future__ import annotations

from omniflow.control.discovery.base import Registry
from omniflow.runtime.actor import MemoryBudget
from omniflow.runtime.config import Config


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


async def budget_after_barrier(
    config: Config, registry: Registry, role: str, replica: int, generation: str
) -> MemoryBudget | None:
    """This replica's budget, after its group's barrier; None if it is in no group."""
    found = config.resources.group_of(role)
    if found is None:
        return None
    name, group = found
    if config.resources.kv_barrier:
        # A device is one host's: on several hosts, only this host's share meets here.
        local = config.local_processes()
        members = sum(local[r].replicas for r in group.fractions if r in local)
        await registry.barrier(
            f"{config.name}/{generation}/kv/{name}",
            members,
            f"{role}/{replica}",
            config.resources.barrier_timeout_s,
        )
    return MemoryBudget(group.device, free_bytes(group.device), group.fractions[role])
