"""Co-located roles: the KV barrier makes every role measure memory after all loaded weights."""

from __future__ import annotations

import asyncio

import pytest

import omniflow
from omniflow.control.discovery import list_actors
from omniflow.runtime.config import ConfigError, parse

R = "tests.graph_roles:Colocated"


def colocated_config(registry="embedded", name="coloc"):
    return parse(
        {
            "name": name,
            "registry": registry,
            "roles": {
                "fast": {"actor": R, "options": {"load_s": 0.0}},
                "slow": {"actor": R, "replicas": 2, "options": {"load_s": 1.5, "weights_mb": 64}},
            },
            "graph": {"edges": [{"from": "input", "to": "fast"}, {"from": "fast", "to": "slow"}]},
            "resources": {
                "groups": {"dev0": {"device": "cpu", "fractions": {"fast": 0.5, "slow": 0.25}}}
            },
        }
    )


def check(cfg):
    async def main():
        async with omniflow.Runtime(cfg) as rt:
            records = await list_actors(rt.client.registry, cfg.name)
            await rt.call({"x": 1})
            return records

    records = asyncio.run(main())
    assert len(records) == 3
    last_setup = max(r.meta["setup_done"] for r in records)
    first_measure = min(r.meta["measured"] for r in records)
    assert first_measure >= last_setup  # nobody sized memory before every neighbour loaded
    fractions = {r.role: r.meta["fraction"] for r in records}
    assert fractions == {"fast": 0.5, "slow": 0.25}
    assert all(r.meta["budget_bytes"] > 0 for r in records)


def test_kv_barrier_embedded(run_root):
    check(colocated_config())


@pytest.mark.etcd
def test_kv_barrier_etcd(run_root, etcd_url):
    check(colocated_config(registry=etcd_url, name="colocetcd"))


@pytest.mark.parametrize(
    "groups, message",
    [
        ({"g": {"device": "cpu", "fractions": {"nope": 0.5}}}, "fractions.nope: unknown role"),
        ({"g": {"device": "cpu", "fractions": {"fast": 0.7, "slow": 0.6}}}, "sum to 1.3"),
        (
            {"g": {"device": "tpu", "fractions": {"fast": 0.5}}},
            'device = "tpu": expected str matching regex',
        ),
        (
            {"g": {"fractions": {"fast": 0.5}}, "h": {"fractions": {"fast": 0.1}}},
            "already in group",
        ),
    ],
)
def test_resource_errors_name_the_field(groups, message):
    raw = {
        "name": "x",
        "roles": {"fast": {"actor": R}, "slow": {"actor": R}},
        "graph": {"edges": [{"from": "input", "to": "fast"}, {"from": "fast", "to": "slow"}]},
        "resources": {"groups": groups},
    }
    with pytest.raises(ConfigError, match=message):
        parse(raw, "<r>")
