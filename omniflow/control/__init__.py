"""The Control Flow layer: the graph DSL and its plan, balance policies, the producer's
routing, joins, and discovery (``control.discovery``)."""

from omniflow.control.balance import POLICIES, NoReplicaError, PickKey, Policy, make_policy
from omniflow.control.graph import INPUT, Graph, GraphError, Plan, graph_from_edges
from omniflow.control.join import JoinBuffer
from omniflow.control.routing import FULL_CREDIT, Fanout, RouteError, Router

__all__ = [
    "FULL_CREDIT",
    "INPUT",
    "POLICIES",
    "Fanout",
    "Graph",
    "GraphError",
    "JoinBuffer",
    "NoReplicaError",
    "PickKey",
    "Plan",
    "Policy",
    "RouteError",
    "Router",
    "graph_from_edges",
    "make_policy",
]
