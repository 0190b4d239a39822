"""One deployment over hosts made of Linux network namespaces (root; see tests/scaleout).

    frame_gbps       tensors from namespace A to B through omniflow: the codec's Frame refs
                     (zero-copy), an Outbox DEALER to an Inbox ROUTER over tcp://, an ack
                     back to the sender's Inbox once the last tensor was materialized
    frame_curve_gbps the same with CurveZMQ, as a deployment off loopback must run
    tcp_gbps         the same bytes over a plain TCP socket between the same namespaces
    rps_by_hosts     LongCat text requests/s with the llm replicated on 1, 2, 3 hosts

The three throughputs run in interleaved rounds (frame, curve, tcp, frame, ...) of
``--rounds``; medians. ``rps_by_hosts`` grows the deployment 1 -> 2 -> 3 llm hosts, then
shrinks it 3 -> 2 -> 1 (`omniflow down --host-id`), measuring twice at each step: each
figure is the median of its measurements on the way up and down. On a machine of 2 cores, three hosts' llms share
those cores: the figures show the overhead of spreading, not a speed-up — that needs
hosts with cores (or GPUs) of their own.

    kv_pull_ms_2048  a puller in namespace A takes a 2,048-token prefix's KV pages from a
                     holder in namespace B (prepare, then fetch with a one-time token, over
                     tcp with CurveZMQ; benchmarks/kv_pull.py)
    recompute_ms_2048  the puller's engine prefilling the same prefix instead; rounds
                     interleaved with the pulls

The CPU it ran on is printed first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Run as a script from a checkout: import this checkout's omniflow, not an installed one.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import cpu_name, emit, median, scratch_dir  # noqa: E402

MiB = 1 << 20
TENSOR_MB = 16
TENSORS_PER_ROUND = 16  # 256 MiB a round


# ---------------------------------------------------------------- throughput: receiver


def receive(address: str, keys_dir: str) -> None:
    """In namespace B: a plain and a CurveZMQ Inbox, and a TCP listener; their ports go
    to stdout as one JSON line; runs until stdin closes."""
    import uvloop

    uvloop.run(_receive(address, keys_dir))


async def _receive(address: str, keys_dir: str) -> None:
    import zmq

    from omniflow.messages import Call
    from omniflow.transport.codec import decode, decoder_for, materialize_tensors
    from omniflow.transport.endpoint import Inbox, Outbox
    from omniflow.transport.security import load_keys

    keys = load_keys(keys_dir)
    ctx = zmq.Context()
    decoder = decoder_for(Call)
    outboxes = {False: Outbox(ctx, 30.0), True: Outbox(ctx, 30.0, keys=keys)}

    def on_message(curve: bool):
        def handle(identity: bytes, parts: list[Any]) -> None:
            call = decode(parts[0], decoder)
            tensors = materialize_tensors(call.tensors, parts)  # the view a role gets
            assert tensors["x"].numel() == TENSOR_MB * MiB
            if call.params.get("last"):
                outboxes[curve].post(call.reply_to, [b"ack"])

        return handle

    plain = Inbox(ctx, f"tcp://{address}:*", on_message(False))
    curve = Inbox(ctx, f"tcp://{address}:*", on_message(True), keys=keys)
    plain.start()
    curve.start()
    listener = socket.create_server((address, 0))
    threading.Thread(target=_tcp_sink, args=(listener,), daemon=True).start()
    ports = {"frame": plain.endpoint, "curve": curve.endpoint, "tcp": listener.getsockname()[1]}
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    plain.close()
    curve.close()
    for outbox in outboxes.values():
        outbox.close()
    ctx.term()


def _tcp_sink(listener: socket.socket) -> None:
    """Each round: an 8-byte length, that many bytes read into one reused buffer, an ack."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = memoryview(bytearray(TENSOR_MB * MiB))
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        left = int.from_bytes(head, "little")
        while left:
            got = conn.recv_into(buffer[: min(left, len(buffer))])
            if not got:
                return
            left -= got
        conn.sendall(b"k")


# ---------------------------------------------------------------- throughput: sender


def send(address: str, ports: str, keys_dir: str, rounds: int) -> None:
    import uvloop

    print(json.dumps(uvloop.run(_send(address, json.loads(ports), keys_dir, rounds))), flush=True)


async def _send(address: str, ports: dict, keys_dir: str, rounds: int) -> dict[str, list[float]]:
    import torch
    import zmq

    from omniflow.messages import Call
    from omniflow.transport.codec import encode, export_tensors
    from omniflow.transport.endpoint import Inbox, Outbox
    from omniflow.transport.links import Link
    from omniflow.transport.security import load_keys

    keys = load_keys(keys_dir)
    ctx = zmq.Context()
    tensor = torch.randint(0, 255, (TENSOR_MB * MiB,), dtype=torch.uint8)
    acks: dict[bool, asyncio.Future] = {}

    def on_ack(curve: bool):
        def handle(identity: bytes, parts: list[Any]) -> None:
            if not acks[curve].done():
                acks[curve].set_result(None)

        return handle

    inboxes = {
        False: Inbox(ctx, f"tcp://{address}:*", on_ack(False)),
        True: Inbox(ctx, f"tcp://{address}:*", on_ack(True), keys=keys),
    }
    outboxes = {False: Outbox(ctx, 30.0), True: Outbox(ctx, 30.0, keys=keys)}
    for inbox in inboxes.values():
        inbox.start()
    host = ports["frame"].split("//")[1].rsplit(":", 1)[0]
    tcp = socket.create_connection((host, ports["tcp"]))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    loop = asyncio.get_running_loop()

    async def frames(curve: bool) -> float:
        acks[curve] = loop.create_future()
        target = ports["curve" if curve else "frame"]
        started = time.perf_counter()
        for i in range(TENSORS_PER_ROUND):
            parts: list[Any] = [b""]
            last = i == TENSORS_PER_ROUND - 1
            call = Call(f"bench-{i}", "sink", inboxes[curve].endpoint, params={"last": last})
            call.tensors = export_tensors({"x": tensor}, parts, Link())  # another host
            parts[0] = encode(call)
            await outboxes[curve].send(target, parts)
        await asyncio.wait_for(acks[curve], 120)
        return time.perf_counter() - started

    def plain_tcp() -> float:
        view = memoryview(tensor.numpy())
        started = time.perf_counter()
        tcp.sendall((TENSORS_PER_ROUND * len(view)).to_bytes(8, "little"))
        for _ in range(TENSORS_PER_ROUND):
            tcp.sendall(view)
        assert tcp.recv(1) == b"k"
        return time.perf_counter() - started

    gbits = TENSORS_PER_ROUND * TENSOR_MB * MiB * 8 / 1e9
    await frames(False)  # warm: connections made, buffers touched
    await frames(True)
    plain_tcp()
    samples: dict[str, list[float]] = {"frame": [], "curve": [], "tcp": []}
    for _ in range(rounds):
        samples["frame"].append(gbits / await frames(False))
        samples["curve"].append(gbits / await frames(True))
        samples["tcp"].append(gbits / await loop.run_in_executor(None, plain_tcp))
    tcp.close()
    for inbox in inboxes.values():
        inbox.close()
    for outbox in outboxes.values():
        outbox.close(linger_ms=0)
    ctx.term()
    return samples


def throughput(hosts: Any, keys: Path, rounds: int) -> dict[str, list[float]]:
    me = [sys.executable, str(Path(__file__).resolve())]
    sink = hosts.popen("b", [*me, "--receive", hosts.address["b"], "--keys", str(keys)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert sink.stdout is not None and sink.stdin is not None
        ports = sink.stdout.readline()
        if not ports:
            raise RuntimeError("the receiver in namespace b did not start")
        argv = [*me, "--send", hosts.address["a"], "--ports", ports.strip(), "--keys", str(keys),
                "--rounds", str(rounds)]  # fmt: skip
        proc = hosts.run("a", argv, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the sender failed:\n{proc.stderr}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        if sink.stdin is not None:
            sink.stdin.close()
        sink.wait(30)


# ---------------------------------------------------------------- requests/s by hosts


class Deployment:
    """LongCat over namespaces a, b, c: a runs every role, b and c only an llm each."""

    ROLES = {
        "a": "vision_encoder,audio_encoder,llm,image_decoder,audio_decoder",
        "b": "llm",
        "c": "llm",
    }

    def __init__(self, hosts: Any, etcd_url: str, keys: Path, work: Path) -> None:
        from tests.scaleout.conftest import longcat_toml

        self.hosts, self.etcd_url, self.work = hosts, etcd_url, work
        self.name = f"bench{hosts.tag}"
        self.config = work / "longcat.toml"
        self.config.write_text(longcat_toml(self.name, etcd_url, hosts, keys, on=()))
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMNIFLOW_RUN_ROOT": str(work / "run")}

    def up(self, host: str) -> None:
        self.hosts.omniflow(host, "up", str(self.config), "--detach", "--host-id", host,
                            "--roles", self.ROLES[host], "--address", self.hosts.address[host],
                            cwd=self.work, env=self.env)  # fmt: skip

    def down(self, host: str) -> None:
        self.hosts.omniflow(host, "down", "--name", self.name, "--host-id", host,
                            "--timeout", "10", cwd=self.work, env=self.env)  # fmt: skip


async def requests_per_s(deployment: Deployment, llm_hosts: int, n: int, concurrency: int) -> float:
    import omniflow

    conn = await omniflow.connect(
        deployment.name, registry=deployment.etcd_url, address=deployment.hosts.bridge_address
    )
    async with conn:
        view, deadline = conn.client.view, time.monotonic() + 60
        while len(view.replicas("llm")) != llm_hosts:  # the view has seen the change
            if time.monotonic() > deadline:
                raise RuntimeError(f"expected {llm_hosts} llm replicas in the registry")
            await asyncio.sleep(0.1)
        params = {"max_tokens": 16}
        await asyncio.gather(*(conn.call({"text": f"warm {i}"}, params=params)
                               for i in range(concurrency)))  # fmt: skip
        left = iter(range(n))

        async def worker() -> None:
            for i in left:
                await conn.call({"text": f"tell me about {i}"}, params=params, timeout=120)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - started)


def rps_by_hosts(hosts: Any, etcd_url: str, keys: Path, work: Path, n: int) -> dict[str, float]:
    import uvloop

    deployment = Deployment(hosts, etcd_url, keys, work)
    samples: dict[int, list[float]] = {1: [], 2: [], 3: []}
    # a first: it builds the tiny models that b and c then load
    steps = [("up", "a", 1), ("up", "b", 2), ("up", "c", 3), ("down", "c", 2), ("down", "b", 1)]
    try:
        for action, host, llm_hosts in steps:
            getattr(deployment, action)(host)
            for _ in range(2):
                rps = uvloop.run(requests_per_s(deployment, llm_hosts, n, concurrency=6))
                samples[llm_hosts].append(rps)
                print(f"llm on {llm_hosts} host(s): {rps:.2f} requests/s", file=sys.stderr)
    finally:
        for host in ("a", "b", "c"):
            subprocess.run(["ip", "netns", "exec", hosts.namespace[host], sys.executable, "-m",
                            "omniflow.cli", "down", "--name", deployment.name, "--host-id", host],
                           capture_output=True, env=deployment.env, timeout=60)  # fmt: skip
    return {str(k): round(median(v), 3) for k, v in samples.items()}


def kv_pull_figures(hosts: Any, keys: Path, work: Path, rounds: int) -> dict[str, Any]:
    """Pulling a 2,048-token prefix's KV from a holder in namespace b into a puller in
    namespace a, over tcp with CurveZMQ, against prefilling it there
    (benchmarks/kv_pull.py: the same model and engine settings, interleaved rounds)."""
    script = str(ROOT / "benchmarks" / "kv_pull.py")
    model = work / "kv-model"
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                           f"import kv_pull; kv_pull.build_model({str(model)!r})"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"building the KV pull model failed:\n{proc.stderr}")
    bind = f"tcp://{hosts.address['b']}:*"
    serve = [sys.executable, script, "--serve", bind, "--model", str(model), "--keys", str(keys)]
    holder = hosts.popen("b", serve, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline().strip()
        if not line.startswith("ENDPOINT "):
            raise RuntimeError(f"the KV holder in namespace b did not start: {line!r}")
        pull = [sys.executable, script, "--pull", line.split(" ", 1)[1], "--model", str(model),
                "--keys", str(keys), "--rounds", str(rounds)]  # fmt: skip
        run = hosts.run("a", pull, timeout=900)
        if run.returncode != 0:
            raise RuntimeError(f"the KV puller in namespace a failed:\n{run.stderr}")
        figures = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(60)
    return {
        "kv_pull_ms_2048": round(figures["kv_pull_ms_2048"], 1),
        "recompute_ms_2048": round(figures["recompute_ms_2048"], 1),
        "kv_pull_link_gbps": round(figures["link_gbps"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=120, help="per measurement of rps")
    parser.add_argument("--skip-rps", action="store_true", help="throughput only")
    parser.add_argument("--receive", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--send", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    parser.add_argument("--keys", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        return receive(args.receive, args.keys)
    if args.send:
        return send(args.send, args.ports, args.keys, args.rounds)

    from omniflow.runtime.config import generate_keys
    from tests.etcd_server import EtcdServer, etcd_binary
    from tests.scaleout.netns import Hosts

    print(f"cpu: {cpu_name()}", file=sys.stderr)
    work = scratch_dir("ofb-so-", parent="/tmp")
    keys = work / "keys"
    generate_keys(str(keys))
    hosts = Hosts(("a", "b", "c")).make()
    etcd = None
    try:
        samples = throughput(hosts, keys, args.rounds)
        result: dict[str, Any] = {
            "cpu": cpu_name(),
            "frame_gbps": round(median(samples["frame"]), 3),
            "frame_curve_gbps": round(median(samples["curve"]), 3),
            "tcp_gbps": round(median(samples["tcp"]), 3),
        }
        result["frame_vs_tcp"] = round(result["frame_gbps"] / result["tcp_gbps"], 3)
        print(f"throughput rounds (Gbit/s): {json.dumps(samples)}", file=sys.stderr)
        result.update(kv_pull_figures(hosts, keys, work, min(args.rounds, 5)))
        if not args.skip_rps:
            binary = etcd_binary()
            if binary is None:
                raise SystemExit("etcd not found (apt-get install etcd-server)")
            etcd = EtcdServer(binary, work / "etcd", host=hosts.bridge_address)
            (work / "etcd").mkdir()
            etcd.start()
            result["rps_by_hosts"] = rps_by_hosts(hosts, etcd.url, keys, work, args.requests)
    finally:
        hosts.remove()
        if etcd is not None:
            etcd.stop()
    emit(result)


if __name__ == "__main__":
    main()
