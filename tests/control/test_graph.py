"""The graph DSL: validation at build time, and routing with real processes."""

from __future__ import annotations

import asyncio

import pytest

import omniflow
from omniflow.control.graph import INPUT, Graph, GraphError, graph_from_edges
from omniflow.runtime.config import ConfigError, parse

OMNI_EDGES = [
    {"from": "input", "to": "vision", "when": "has_image"},
    {"from": "input", "to": "audio", "when": "has_audio"},
    {"from": "input", "to": "llm"},
    {"from": "vision", "to": "llm"},
    {"from": "audio", "to": "llm"},
    {"from": "llm", "to": "imgdec", "when": "has:image_codes"},
]
OMNI_ROLES = {"vision", "audio", "llm", "imgdec"}


def omni_config(**extra):
    R = "tests.graph_roles"
    return parse(
        {
            "name": "graph",
            "roles": {
                "vision": {"actor": f"{R}:Encoder", "options": {"key": "image"}},
                "audio": {"actor": f"{R}:Encoder", "options": {"key": "audio"}},
                "llm": {"actor": f"{R}:Joiner", "replicas": 2},
                "imgdec": {"actor": f"{R}:Decoder"},
                **extra.get("roles", {}),
            },
            "graph": {"edges": OMNI_EDGES + extra.get("edges", [])},
        }
    )


# ------------------------------------------------------------------ build time


def test_python_and_toml_forms_compile_to_the_same_plan():
    g = Graph()
    g.edge("input", "vision", when="has_image").edge("input", "audio", when="has_audio")
    g.edge("input", "llm").edge("vision", "llm").edge("audio", "llm")
    g.edge("llm", "imgdec", when="has:image_codes")
    a = g.compile(OMNI_ROLES)
    b = graph_from_edges(OMNI_EDGES).compile(OMNI_ROLES)
    assert a.edges == b.edges
    assert a.joins == b.joins == {"llm"}
    assert a.entry_roles() == b.entry_roles() == {"vision", "audio", "llm"}


@pytest.mark.parametrize(
    "edges, roles, message",
    [
        ([("input", "a"), ("a", "ghost")], {"a"}, "edge a -> ghost: unknown role 'ghost'"),
        ([("input", "a"), ("a", "b"), ("b", "a")], {"a", "b"}, "unbounded cycle"),
        ([("input", "a")], {"a", "lonely"}, "role 'lonely' is unreachable"),
        ([("a", "b")], {"a", "b"}, "no edge from 'input'"),
        ([("input", "a"), ("a", "input")], {"a"}, "nothing can send to 'input'"),
    ],
)
def test_invalid_graphs_fail_at_build_time(edges, roles, message):
    g = Graph()
    for src, dst in edges:
        g.edge(src, dst)
    with pytest.raises(GraphError, match=message):
        g.compile(roles)


def test_join_behind_a_conditional_edge_is_rejected():
    g = Graph().edge("input", "enc", when="has_image").edge("input", "llm")
    g.edge("enc", "mid").edge("mid", "llm", when="has_text")
    with pytest.raises(GraphError, match="join 'llm' can never complete"):
        g.compile({"enc", "mid", "llm"})


def test_unknown_predicate_is_named():
    with pytest.raises(GraphError, match="unknown predicate 'has_smell'"):
        Graph().edge("input", "a", when="has_smell").compile({"a"})


def test_bounded_loop_is_accepted_and_counted():
    plan = Graph().edge("input", "a").edge("a", "a", max_iters=3).compile({"a"})
    loop = plan.out_edges["a"][0]
    assert [r.edge for r in plan.route("a", {}, {}, {})] == [loop]
    assert plan.route("a", {}, {}, {loop.key: 3}) == []


def test_downstream_follows_every_edge_after_a_role():
    g = Graph().edge(INPUT, "vision").edge(INPUT, "llm").edge("vision", "llm")
    g.edge("llm", "image", when="has:image_codes").edge("llm", "audio")
    g.edge("refine", "llm", max_iters=2).edge("image", "refine")
    plan = g.compile({"vision", "llm", "image", "audio", "refine"})
    assert plan.downstream("vision") == {"llm", "image", "audio", "refine"}
    assert plan.downstream("audio") == set()
    assert plan.downstream("image") == {"refine", "llm", "image", "audio"}  # a loop back


def test_config_graph_errors_name_the_file():
    with pytest.raises(ConfigError, match=r"<x>: \[graph\] edge input -> b: unknown role 'b'"):
        parse(
            {
                "name": "x",
                "roles": {"a": {"actor": "omniflow.roles.echo:Upper"}},
                "graph": {"edges": [{"from": "input", "to": "b"}]},
            },
            "<x>",
        )


def test_conditional_routes_taken_exactly_when_they_should():
    plan = graph_from_edges(OMNI_EDGES).compile(OMNI_ROLES)

    def dsts(out, src=INPUT, params=None):
        if params is None:
            params = {}
        return sorted(r.edge.dst for r in plan.route(src, params, out))

    assert dsts({"text": "t"}) == ["llm"]
    assert dsts({"text": "t", "image": b"i"}) == ["llm", "vision"]
    assert dsts({"audio": b"a"}) == ["audio", "llm"]
    assert dsts({"image": b"i", "audio": b"a"}) == ["audio", "llm", "vision"]
    assert dsts({"text": "x"}, "llm") == []
    assert dsts({"image_codes": [1]}, "llm") == ["imgdec"]


# ------------------------------------------------------------------ real processes


def run(cfg, body):
    async def main():
        async with omniflow.Runtime(cfg) as rt:
            return await body(rt)

    return asyncio.run(main())


def test_fan_out_and_join_with_optional_inputs(run_root):
    async def body(rt):
        results = {}
        for name, inputs in {
            "text": {"text": "t"},
            "image": {"text": "t", "image": b"png"},
            "audio": {"text": "t", "audio": b"wav"},
            "both": {"text": "t", "image": b"png", "audio": b"wav"},
        }.items():
            outs, result = await rt.call(inputs)
            assert len(outs) == 1 and outs[0].role == "llm"
            results[name] = (outs[0].data["keys"], sorted(t.role for t in result.timings))
        # concurrency: joins of many requests interleave without mixing
        many = await asyncio.gather(
            *(rt.call({"text": str(i), "image": b"x" * i}) for i in range(30))
        )
        assert [o[0][0].data["text"] for o in many] == [str(i) for i in range(30)]
        return results

    r = run(omni_config(), body)
    assert r["text"] == (["text"], ["llm"])
    assert r["image"] == (["image", "image_embeds", "image_vec", "text"], ["llm", "vision"])
    assert r["audio"] == (["audio", "audio_embeds", "audio_vec", "text"], ["audio", "llm"])
    assert r["both"][0] == sorted(
        ["text", "image", "audio", "image_embeds", "image_vec", "audio_embeds", "audio_vec"]
    )
    assert r["both"][1] == ["audio", "llm", "vision"]


def test_conditional_route_to_a_decoder_end_to_end(run_root):
    async def body(rt):
        plain, _ = await rt.call({"text": "t"})
        wants, result = await rt.call({"text": "t"}, params={"want": "text,image"})
        return plain, wants, result

    plain, wants, result = run(omni_config(), body)
    assert [o.role for o in plain] == ["llm"]
    assert [o.role for o in wants] == ["imgdec"]
    assert wants[0].data["decoded"] == [1, 2, 3]
    assert sorted(t.role for t in result.timings) == ["imgdec", "llm"]


def test_streaming_order_across_three_roles(run_root):
    E = "omniflow.roles.echo"
    cfg = parse(
        {
            "name": "three",
            "roles": {
                "a": {"actor": f"{E}:Upper"},
                "b": {"actor": f"{E}:Reverse"},
                "c": {"actor": f"{E}:Upper"},
            },
            "graph": {
                "edges": [
                    {"from": "input", "to": "a"},
                    {"from": "a", "to": "b", "stream": True},
                    {"from": "b", "to": "c", "stream": True},
                ]
            },
        }
    )
    text = " ".join(f"w{i}" for i in range(40))

    async def body(rt):
        return [o async for o in rt.stream({"text": text}) if isinstance(o, omniflow.Output)]

    outs = run(cfg, body)
    assert [o.role for o in outs] == ["c"] * 40
    assert [o.seq for o in outs] == list(range(40))
    # a: "W0 " -> b: " 0W" -> c: splits into words again: "0W"
    assert [o.data["text"].strip() for o in outs] == [f"W{i}"[::-1] for i in range(40)]


def test_bounded_loop_runs_exactly_max_iters(run_root):
    cfg = parse(
        {
            "name": "loop",
            "roles": {"count": {"actor": "tests.graph_roles:Counter"}},
            "graph": {
                "edges": [
                    {"from": "input", "to": "count"},
                    {"from": "count", "to": "count", "max_iters": 4},
                ]
            },
        }
    )

    async def body(rt):
        return await rt.call({"n": 0})

    outs, result = run(cfg, body)
    assert [o.data["n"] for o in outs] == [5]  # the first visit plus 4 loop iterations
    assert len(result.timings) == 5


def test_an_input_no_role_accepts_fails_clearly_and_the_next_request_runs(run_root):
    cfg = parse(
        {
            "name": "texts-only",
            "roles": {"rev": {"actor": "omniflow.roles.echo:Reverse"}},
            "graph": {"edges": [{"from": "input", "to": "rev", "when": "has_text"}]},
        }
    )

    async def body(rt):
        with pytest.raises(omniflow.RequestFailed) as failed:
            await rt.call({"image": b"png"})
        outs, _ = await rt.call({"text": "ab"})
        return failed.value, outs

    error, outs = run(cfg, body)
    assert error.code == "bad_request" and error.role == "client"
    assert "no role accepts this input" in str(error) and error.request_id
    assert [o.data["text"] for o in outs] == ["ba"]
