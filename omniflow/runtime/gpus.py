"""GPU placement: which GPUs a replica sees, whether a role uses one, and the config checks.

Torch- and cupy-free: the supervisor and the config loader use it before any process
starts. A role uses a GPU when its ``device`` option is ``cuda`` or ``cuda:N``; its
``gpus`` list becomes each replica's ``CUDA_VISIBLE_DEVICES`` (with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so the ids are ``nvidia-smi``'s), split between
replicas when it holds several per replica:

    gpus = [0, 1, 2, 3], replicas = 2  ->  replica 0 sees 0,1; replica 1 sees 2,3
    gpus = [0, 1],       replicas = 4  ->  replicas 0 and 2 see 0; 1 and 3 see 1

Inside the replica ``cuda:0`` is then the first GPU of its share; across processes a GPU is
named by its PCI bus id (registry records, CUDA IPC refs), never by an ordinal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniflow.memory.pinned import cuda_available


def role_device(options: Mapping[str, Any]) -> str:
    """The role's ``device`` option ("cpu" when it has none: echo, gateway)."""
    device = options.get("device", "cpu")
    return device if isinstance(device, str) else "cpu"


def uses_gpu(options: Mapping[str, Any]) -> bool:
    return role_device(options).startswith("cuda")


def replica_gpus(gpus: list[int], replicas: int, index: int) -> list[int]:
    """The GPU ids replica ``index`` of ``replicas`` sees (module docstring); [] for none."""
    if not gpus:
        return []
    if len(gpus) % replicas == 0:
        share = len(gpus) // replicas
        return gpus[index * share : (index + 1) * share]
    if replicas % len(gpus) == 0:
        return [gpus[index % len(gpus)]]
    raise ValueError(
        f"gpus: {len(gpus)} GPUs cannot be shared evenly by {replicas} replicas "
        "(the count of one must divide the other's)"
    )


def placement_env(env: dict[str, str], gpus: list[int], replicas: int, index: int) -> None:
    """Set ``CUDA_VISIBLE_DEVICES`` in ``env`` for one replica (left as is without ``gpus``)."""
    mine = replica_gpus(gpus, replicas, index)
    if mine:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in mine)


def device_problem(
    options: Mapping[str, Any], gpus: list[int], replicas: int, *, gpu_present: bool | None = None
) -> str:
    """Why this role's device and gpus cannot run here ("" when they can)."""
    try:
        mine = replica_gpus(gpus, replicas, 0)
    except ValueError as e:
        return str(e)
    device = role_device(options)
    if not device.startswith("cuda"):
        return ""
    present = cuda_available() if gpu_present is None else gpu_present
    if not present:
        return (
            f'device = "{device}" but this host has no usable CUDA device (no NVIDIA driver, '
            'or cupy/torch cannot see one): set device = "cpu", or run this role on a GPU host'
        )
    ordinal = int(device.partition(":")[2] or 0)
    if mine and ordinal >= len(mine):
        return (
            f'device = "{device}" but each replica sees {len(mine)} GPU(s) of gpus = {gpus} '
            f"(as cuda:0..cuda:{len(mine) - 1})"
        )
    return ""


def attach_device_pools(pool: Any, cache: Any, options: Mapping[str, Any]) -> list[str]:
    """In a GPU process: send CUDA tensors by IPC from a ``cache.device_pool`` chunk on the
    role's device; returns the PCI bus ids of the GPUs it sees (its registry record's)."""
    from omniflow.memory.cuda_ipc import DevicePool, visible_bus_ids
    from omniflow.transport.links import attach_device_pool

    ordinal = int(role_device(options).partition(":")[2] or 0)
    if cache.device_pool_bytes:
        attach_device_pool(DevicePool(pool, ordinal, cache.device_pool_bytes))
    return visible_bus_ids()
