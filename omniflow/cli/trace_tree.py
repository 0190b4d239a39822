"""`omniflow send --trace`: a request's span tree, from the Timings its roles sent back.

Each role that handled a traced request names its span and the span it hangs under in
its Timing (runtime/tracing.py), so the tree needs no collector: the client's root span,
then each role's under its parent, with its offset from the start, its duration, its wait
for a slot and its compute.
"""

from __future__ import annotations

from typing import Any


def span_tree(
    trace_id: str, root: str, started: float, latency_ms: float, timings: Any
) -> list[str]:
    """Lines of the tree under the client's span ``root`` (started at ``started``)."""
    spans = [t for t in timings if t.span]
    known = {t.span for t in spans} | {root}
    children: dict[str, list[Any]] = {}
    for t in spans:
        # A parent nobody reported (a role without tracing between): under the root.
        children.setdefault(t.parent if t.parent in known else root, []).append(t)
    lines = [f"trace {trace_id}", f"client {root} {latency_ms:.1f} ms"]

    def walk(parent: str, indent: str) -> None:
        below = sorted(children.get(parent, []), key=lambda t: t.arrived)
        for i, t in enumerate(below):
            last = i == len(below) - 1
            lines.append(
                f"{indent}{'└─' if last else '├─'} {t.role}/{t.replica} {t.span} "
                f"+{(t.arrived - started) * 1e3:.1f} ms {(t.left - t.arrived) * 1e3:.1f} ms "
                f"(queued {t.queued_ms:.1f} ms, compute {t.compute_ms:.1f} ms)"
            )
            walk(t.span, indent + ("   " if last else "│  "))

    walk(root, "")
    return lines
