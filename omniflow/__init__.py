"""omniflow: multimodal model pipelines as asyncio actors over ZeroMQ, without Ray."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from omniflow.control.graph import Graph, GraphError
from omniflow.messages import CudaIpc, Frame, Shm, TensorRef
from omniflow.runtime.actor import Actor, BadRequest, Context, Request
from omniflow.runtime.client import Output, RequestFailed, Result
from omniflow.runtime.config import Config, ConfigError
from omniflow.runtime.config import load as load_config
from omniflow.runtime.deployment import Connection, DeploymentNotFound, Runtime, connect
from omniflow.runtime.request_check import InvalidRequest

try:
    __version__ = _version("omniflow")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Actor",
    "BadRequest",
    "Config",
    "ConfigError",
    "Connection",
    "Context",
    "CudaIpc",
    "DeploymentNotFound",
    "Frame",
    "Graph",
    "GraphError",
    "InvalidRequest",
    "Output",
    "Request",
    "RequestFailed",
    "Result",
    "Runtime",
    "Shm",
    "TensorRef",
    "connect",
    "load_config",
]
