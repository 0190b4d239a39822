"""JoinBuffer: parts wait at most until their request's deadline."""

from __future__ import annotations

from omniflow.control.join import JoinBuffer
from omniflow.messages import Call, Join


def _part(request_id: str, part: int, deadline: float) -> Call:
    return Call(
        request_id,
        "joiner",
        "ipc://client",
        {"p": part},
        deadline=deadline,
        join=Join("joiner", "joiner/0", 2, part),
    )


def test_parts_past_their_deadline_expire():
    joins = JoinBuffer("joiner")
    assert joins.add(_part("late", 0, deadline=100.0), [b""]) is None
    assert joins.add(_part("soon", 0, deadline=200.0), [b""]) is None
    assert joins.add(_part("never", 0, deadline=0.0), [b""]) is None
    assert joins.has_deadlines()
    assert joins.expire(now=150.0)[0].request_id == "late"
    assert sorted(rid for rid, _ in joins.waiting()) == ["never", "soon"]
    assert [c.request_id for c in joins.expire(now=250.0)] == ["soon"]
    assert not joins.has_deadlines()  # a part without a deadline waits for a Cancel
    merged, _ = joins.add(_part("never", 1, deadline=0.0), [b""])
    assert merged.data == {"p": 1} and merged.join is None
