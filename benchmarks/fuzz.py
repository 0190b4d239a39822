"""A bounded fuzz run against live deployments: the wire protocol, the HTTP API, TOML
configs and the media decoders, with the strategies of tests/security/fuzzing.py.

Two deployments run for the whole time: one actor with a page pool (the wire target)
and the echo pipeline behind a gateway (the HTTP target). Surfaces take turns in
slices until ``--seconds`` have passed. Then a connection phase (tests/security/
http_conn.py): 300 idle connections past the gateway's cap of 128, 20 slow heads and
bodies, 10 heads of 4 MiB, each answered by a clear 408/431/503, with the gateway's fds
and peak memory. Then, as root, a second-user phase (tests/security/other_user.py): a
user made with useradd tries every folder, file, socket, pool segment and process of
both deployments and the gateway without its key. Then: did any actor die or restart, did any input end without a clear
error, is every pool page back, does each still serve?

    python benchmarks/fuzz.py [--seconds 120]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import cpu_name, emit, short_run_root  # noqa: E402

from tests.security.fuzzing import (  # noqa: E402
    MediaChecker,
    Tally,
    WireChecker,
    check_config,
    check_http,
    config_inputs,
    http_inputs,
    media_inputs,
    run_for,
    wire_inputs,
)
from tests.security.http_conn import connection_phase  # noqa: E402
from tests.security.live import LiveDeployment, Probe, tensor_config  # noqa: E402
from tests.security.other_user import second_user_phase, targets  # noqa: E402

SLICE_S = 5.0
GATEWAY_KEY = "sk-fuzz"
SHARES = {"wire": 0.4, "http": 0.3, "config": 0.15, "media": 0.15}


def gateway_deployment() -> tuple[LiveDeployment, str]:
    from omniflow.runtime.config import GatewayConfig
    from tests.helpers import echo_config

    config = echo_config("fzb", runtime={"heartbeat_s": 0.5, "ttl_s": 10.0})
    config.gateway = GatewayConfig(
        port=0,
        api_key=GATEWAY_KEY,
        max_body_mb=0.25,
        max_connections=128,
        header_timeout_s=2.0,
        body_timeout_s=2.0,
        max_body_reads=16,
        body_memory_mb=4.0,
    )
    dep = LiveDeployment(config, role="upper")
    url_file = Path(dep.rt.supervisor.run_dir) / "gateway.url"
    deadline = time.monotonic() + 60
    while not url_file.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway wrote no gateway.url")
        time.sleep(0.05)
    return dep, url_file.read_text().strip()


def main(seconds: float) -> dict:
    import httpx2 as httpx

    short_run_root()
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cpus)", flush=True)
    tally = Tally()
    actor = LiveDeployment(tensor_config("fzw"))
    web, url = gateway_deployment()
    probe = Probe(actor.replica.endpoint, str(actor.rt.supervisor.run_dir))
    client = httpx.Client()
    scratch = Path(tempfile.mkdtemp(prefix="ofz-"))
    before = actor.pool.stats().used_pages
    wire = WireChecker(actor, probe, tally)
    media = MediaChecker()
    surfaces = {
        "wire": (wire_inputs(), wire.check),
        "http": (http_inputs(), lambda item: check_http(client, url, item, tally, GATEWAY_KEY)),
        "config": (config_inputs(), lambda raw: check_config(scratch / "c.toml", raw, tally)),
        "media": (media_inputs(), lambda item: media.check(item, tally)),
    }
    try:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            for name, (strategy, check) in surfaces.items():
                run_for(min(SLICE_S * SHARES[name] / 0.4, max(left, 0.1)), strategy, check)
                left = end - time.monotonic()
                if left <= 0:
                    break
        gateway = next(r for r in web.rt.supervisor.replicas if r.role == "gateway")
        host, _, port = url.removeprefix("http://").rpartition(":")
        conns = connection_phase(host, int(port), GATEWAY_KEY, gateway.proc.pid, wait_s=6.0)
        tally.tried["connections"] = 330
        for line in conns.pop("unclear"):
            tally.unclear_error("connections", line)
        other = other_user_phase(actor, web, url)
        served_after = probe.served()
        body = {"model": "fzb", "messages": [{"role": "user", "content": "still there"}]}
        r = client.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {GATEWAY_KEY}"},
            timeout=30,
        )
        served_after = served_after and r.status_code == 200
        settle = time.monotonic() + 10
        while actor.pool.stats().used_pages != before and time.monotonic() < settle:
            time.sleep(0.05)
        leaked = (actor.pool.stats().used_pages - before) * actor.pool.page_size
        replicas = [*actor.rt.supervisor.replicas, *web.rt.supervisor.replicas]
        crashes = sum(r.restarts for r in replicas) + sum(
            1 for r in replicas if r.proc is None or r.proc.poll() is not None
        )
    finally:
        client.close()
        probe.close()
        actor.close()
        web.close()
    for line in tally.unclear[:10]:
        print("unclear:", line, flush=True)
    return {
        "seconds": seconds,
        "inputs_tried": tally.tried,
        "actor_crashes": crashes,
        "unclear_errors": len(tally.unclear),
        "pool_leaked_bytes": leaked,
        "served_after": served_after,
        "http_connections": conns,
        "second_user": other,
    }


def other_user_phase(actor: LiveDeployment, web: LiveDeployment, url: str) -> dict:
    """Another local user (made with useradd) against both deployments: folders, files,
    sockets, pool segments, processes, and the gateway without its key. Root only."""
    if os.getuid() != 0:
        return {"skipped": "needs root, to make a second user"}
    found = [targets(actor.rt), targets(web.rt, url, GATEWAY_KEY, "fzb")]
    results = [second_user_phase(f) for f in found]
    breaches = [b for r in results for b in r["breaches"]]
    for line in breaches[:10]:
        print("second user:", line, flush=True)
    return {"tried": sum(r["tried"] for r in results), "breaches": len(breaches)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    emit(main(args.seconds))
