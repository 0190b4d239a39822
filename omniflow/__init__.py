"""omniflow: multimodal model pipelines as asyncio actors over ZeroMQ, without Ray."""

from omniflow.actor import Actor, BadRequest, Context, Request
from omniflow.client import Output, RequestFailed, Result
from omniflow.config import Config, ConfigError
from omniflow.graph import Graph, GraphError
from omniflow.messages import CudaIpc, Frame, Shm, TensorRef
from omniflow.runtime import Connection, DeploymentNotFound, Runtime, connect

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
    "Output",
    "Request",
    "RequestFailed",
    "Result",
    "Runtime",
    "Shm",
    "TensorRef",
    "connect",
]
