"""The graph DSL: roles joined by edges, compiled to a validated ``Plan``.

    g = Graph()
    g.edge("input", "vision_encoder", when="has_image")
    g.edge("input", "llm")
    g.edge("vision_encoder", "llm")
    g.edge("llm", "image_decoder", when="has:image_codes", stream=True)
    plan = g.compile(roles={"vision_encoder", "llm", "image_decoder"})

``input`` is the client's request. An output that takes no edge goes to the
client. Several taken edges fan out; branches that meet again at a role with
several in-edges (a join) are merged there: the join waits for exactly the
branches this request took. A cycle needs ``max_iters`` on one of its edges.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

INPUT = "input"

Predicate = Callable[[Mapping[str, Any], Mapping[str, Any]], bool]
"""``pred(params, output)``: request parameters and the producer's output keys/values."""


class GraphError(ValueError):
    """An invalid graph; the message names the edge or role."""


def _has(*keys: str) -> Predicate:
    return lambda params, output: any(k in output for k in keys)


def _wants(kind: str) -> Predicate:
    return lambda params, output: kind in _want_list(params)


def _want_list(params: Mapping[str, Any]) -> list[str]:
    want = params.get("want", ())
    return [w.strip() for w in want.split(",")] if isinstance(want, str) else list(want)


PREDICATES: dict[str, Predicate] = {
    "always": lambda params, output: True,
    "has_text": _has("text"),
    "has_image": _has("image", "images"),
    "has_audio": _has("audio", "audios"),
    "want_text": _wants("text"),
    "want_image": _wants("image"),
    "want_audio": _wants("audio"),
}


def resolve_predicate(name: str | None) -> tuple[str, Predicate | None]:
    """A predicate by name: a library name, ``has:KEY``, ``not:NAME`` or ``module:function``."""
    if name is None or name == "always":
        return "always", None
    if name.startswith("not:"):
        _, inner = resolve_predicate(name[4:])
        if inner is None:
            raise GraphError(f"predicate {name!r} is never true")
        return name, lambda params, output: not inner(params, output)
    if name.startswith("has:"):
        return name, _has(name[4:])
    if name in PREDICATES:
        return name, PREDICATES[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise GraphError(f"predicate {name!r} cannot be imported: {e}") from None
        if not callable(fn):
            raise GraphError(f"predicate {name!r} is not callable")
        return name, fn
    known = ", ".join(sorted(PREDICATES))
    raise GraphError(
        f"unknown predicate {name!r}: use one of {known}, has:KEY, not:NAME or module:function"
    )


class Edge(NamedTuple):
    src: str
    dst: str
    when: str = "always"
    stream: bool = False
    max_iters: int = 0  # > 0 marks a loop edge, taken at most this many times per request

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}" + ("" if self.when == "always" else f" [{self.when}]")

    @property
    def key(self) -> str:
        return f"{self.src}>{self.dst}"


class Graph:
    """Roles and edges, declared in Python (or loaded from a config's ``[graph]``)."""

    def __init__(self) -> None:
        self.edges: list[Edge] = []

    def edge(
        self,
        src: str,
        dst: str,
        when: str | None = None,
        stream: bool = False,
        max_iters: int = 0,
    ) -> Graph:
        self.edges.append(Edge(src, dst, when or "always", stream, max_iters))
        return self

    def chain(self, *roles: str, stream: bool = False) -> Graph:
        """``input -> roles[0] -> roles[1] -> ...``, unconditional."""
        prev = INPUT
        for role in roles:
            self.edge(prev, role, stream=stream)
            prev = role
        return self

    def compile(self, roles: Iterable[str]) -> Plan:
        return Plan(self.edges, set(roles))


class Route(NamedTuple):
    """An edge taken for one output; ``join`` names the role where branches meet."""

    edge: Edge
    join: str | None


class Plan:
    """A validated graph: answers "where does this output go next?"."""

    def __init__(self, edges: list[Edge], roles: set[str]) -> None:
        self.roles = roles
        self.edges = list(edges)
        self._preds: dict[Edge, Predicate | None] = {}
        self.out_edges: dict[str, list[Edge]] = {}
        self.in_edges: dict[str, list[Edge]] = {}
        for e in self.edges:
            for end in (e.src, e.dst):
                if end != INPUT and end not in roles:
                    raise GraphError(f"edge {e}: unknown role {end!r}")
            if e.dst == INPUT:
                raise GraphError(f"edge {e}: nothing can send to {INPUT!r}")
            if e.max_iters < 0:
                raise GraphError(f"edge {e}: max_iters must be >= 0")
            self._preds[e] = resolve_predicate(e.when)[1]
            self.out_edges.setdefault(e.src, []).append(e)
            self.in_edges.setdefault(e.dst, []).append(e)
        if not self.out_edges.get(INPUT):
            raise GraphError(f"the graph has no edge from {INPUT!r}: no role takes requests")
        self._check_reachable()
        self._check_cycles()
        self.joins = {r for r, ins in self.in_edges.items() if len(ins) > 1 and not _loop_only(ins)}
        self._join_of: dict[Edge, str | None] = {e: self._follow_to_join(e) for e in self.edges}
        # Per source: each out edge's predicate and its (immutable) Route, looked up once
        # here rather than hashed per output.
        self._routes: dict[str, list[tuple[Edge, Predicate | None, Route]]] = {
            src: [(e, self._preds[e], Route(e, self._join_of[e])) for e in out]
            for src, out in self.out_edges.items()
        }

    def entry_roles(self) -> set[str]:
        return {e.dst for e in self.out_edges[INPUT]}

    def downstream(self, role: str) -> set[str]:
        """Every role a request can reach after ``role`` (``role`` itself only if a loop
        leads back to it)."""
        seen: set[str] = set()
        todo = [role]
        while todo:
            for e in self.out_edges.get(todo.pop(), ()):
                if e.dst not in seen:
                    seen.add(e.dst)
                    todo.append(e.dst)
        return seen

    def route(
        self,
        src: str,
        params: Mapping[str, Any],
        output: Mapping[str, Any],
        loops: Mapping[str, int] | None = None,
    ) -> list[Route]:
        """The edges ``output`` of ``src`` takes; [] means it goes to the client.

        A loop edge is taken while its count in ``loops`` is below ``max_iters``.
        """
        taken = []
        for e, pred, route in self._routes.get(src, ()):
            if e.max_iters and (loops or {}).get(e.key, 0) >= e.max_iters:
                continue
            if pred is None or pred(params, output):
                taken.append(route)
        return taken

    # ------------------------------------------------------------ validation

    def _check_reachable(self) -> None:
        seen, todo = set(), [INPUT]
        while todo:
            node = todo.pop()
            for e in self.out_edges.get(node, ()):
                if e.dst not in seen:
                    seen.add(e.dst)
                    todo.append(e.dst)
        unreachable = sorted(self.roles - seen)
        if unreachable:
            raise GraphError(f"role {unreachable[0]!r} is unreachable from {INPUT!r}")

    def _check_cycles(self) -> None:
        # Drop bounded loop edges; whatever cycle remains is unbounded.
        state: dict[str, int] = {}

        def visit(node: str, path: list[Edge]) -> None:
            state[node] = 1
            for e in self.out_edges.get(node, ()):
                if e.max_iters:
                    continue
                if state.get(e.dst) == 1:
                    cycle = ", ".join(map(str, [*path, e]))
                    raise GraphError(
                        f"unbounded cycle through edge {e} (path: {cycle}); "
                        "give one of its edges max_iters"
                    )
                if e.dst not in state:
                    visit(e.dst, [*path, e])
            state[node] = 2

        visit(INPUT, [])

    def _follow_to_join(self, edge: Edge) -> str | None:
        """The join this edge's branch reaches, following unconditional single edges."""
        node, seen = edge.dst, set()
        while node not in seen:
            seen.add(node)
            if node in self.joins:
                return node
            outs = [e for e in self.out_edges.get(node, ()) if not e.max_iters]
            if len(outs) != 1:
                break
            nxt = outs[0]
            if nxt.dst in self.joins and self._preds[nxt] is not None:
                raise GraphError(
                    f"join {nxt.dst!r} can never complete reliably: edge {nxt} is conditional "
                    "between a split and its join"
                )
            node = nxt.dst
        return None


def _loop_only(ins: list[Edge]) -> bool:
    return sum(1 for e in ins if not e.max_iters) <= 1


def graph_from_edges(specs: Iterable[Mapping[str, Any]]) -> Graph:
    """The TOML form: ``[[graph.edges]]`` tables with from/to/when/stream/max_iters."""
    g = Graph()
    for spec in specs:
        g.edge(
            spec["from"],
            spec["to"],
            when=spec.get("when"),
            stream=bool(spec.get("stream", False)),
            max_iters=int(spec.get("max_iters", 0)),
        )
    return g
