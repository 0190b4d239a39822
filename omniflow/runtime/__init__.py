"""The runtime: what a role's author writes (``Actor``, ``Context``), the actor host and
its in-flight requests, the worker process, the supervisor, the client, configs, and the
embeddable ``Runtime``.

The names below import their module on first use: a role that needs only ``Actor`` or
the thread-priority helpers does not load the supervisor and the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniflow.lazy import exports

_WHERE = {
    "Actor": "omniflow.runtime.actor",
    "BadRequest": "omniflow.runtime.actor",
    "Config": "omniflow.runtime.config",
    "ConfigError": "omniflow.runtime.config",
    "Connection": "omniflow.runtime.deployment",
    "Context": "omniflow.runtime.actor",
    "DeploymentNotFound": "omniflow.runtime.deployment",
    "MemoryBudget": "omniflow.runtime.actor",
    "Output": "omniflow.runtime.client",
    "Request": "omniflow.runtime.actor",
    "RequestFailed": "omniflow.runtime.client",
    "Result": "omniflow.runtime.client",
    "Runtime": "omniflow.runtime.deployment",
    "StartError": "omniflow.runtime.replica",
    "Supervisor": "omniflow.runtime.supervisor",
    "connect": "omniflow.runtime.deployment",
    "find_deployment": "omniflow.runtime.deployment",
    "load": "omniflow.runtime.config",
}

__all__ = [
    "Actor",
    "BadRequest",
    "Config",
    "ConfigError",
    "Connection",
    "Context",
    "DeploymentNotFound",
    "MemoryBudget",
    "Output",
    "Request",
    "RequestFailed",
    "Result",
    "Runtime",
    "StartError",
    "Supervisor",
    "connect",
    "find_deployment",
    "load",
]

if TYPE_CHECKING:
    from omniflow.runtime.actor import Actor, BadRequest, Context, MemoryBudget, Request
    from omniflow.runtime.client import Output, RequestFailed, Result
    from omniflow.runtime.config import Config, ConfigError, load
    from omniflow.runtime.deployment import (
        Connection,
        DeploymentNotFound,
        Runtime,
        connect,
        find_deployment,
    )
    from omniflow.runtime.replica import StartError
    from omniflow.runtime.supervisor import Supervisor

__getattr__ = exports(__name__, _WHERE)
