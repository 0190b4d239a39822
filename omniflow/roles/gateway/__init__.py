"""The HTTP gateway: an OpenAI-compatible front for a deployment, run as a role.

``omniflow up`` starts it when the config has a ``[gateway]`` table; it is outside the
graph and reaches the deployment through an ordinary ``Client``.
"""

from omniflow.roles.gateway.actor import Gateway
from omniflow.roles.gateway.schema import ApiError

__all__ = ["ApiError", "Gateway"]
