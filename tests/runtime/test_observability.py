"""What an operator sees of a real deployment (gateway, vision encoder, tiny LLM, started
by `omniflow up --log-format json`): every replica's engine figures in the gateway's
/metrics, JSON log lines (start-up banners, access lines), and one trace per request at
an OTLP/HTTP receiver this test runs."""

from __future__ import annotations

import base64
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import cli
from tests.roles.media import image_bytes
from tests.runtime.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
CONFIG = """
name = "obs"
[roles.vision_encoder]
actor = "omniflow.roles.vision_encoder:VisionEncoderRole"
options = {{ model_path = "{models}/vision", build_tiny = true, threads = 1 }}
[roles.llm]
actor = "omniflow.roles.llm:LLMRole"
options = {{ model_path = "{models}/llm", build_tiny = true, kv_cache_mb = 8, threads = 1 }}
[graph]
edges = [
  {{ from = "input", to = "vision_encoder", when = "has_image" }},
  {{ from = "input", to = "llm" }},
  {{ from = "vision_encoder", to = "llm" }},
]
[runtime]
heartbeat_s = 0.2
ttl_s = 2.0
start_timeout_s = 180
[gateway]
port = 0
[tracing]
endpoint = "{endpoint}"
"""


@pytest.fixture(scope="module")
def deployment():
    root = Path(tempfile.mkdtemp(prefix="of-obs-", dir="/tmp"))
    run_dir = root / "run"
    with OtlpReceiver() as receiver:
        toml = root / "obs.toml"
        toml.write_text(CONFIG.format(models=root / "models", endpoint=receiver.url))
        cli("up", str(toml), "-d", "--log-format", "json", "--run-dir", str(run_dir), timeout=300)
        url = (run_dir / "gateway.url").read_text().strip()
        try:
            yield url, run_dir, receiver
        finally:
            cli("down", "--run-dir", str(run_dir), check=False)
            shutil.rmtree(root, ignore_errors=True)


def chat(url: str, text: str = "hello there", image: bool = False, **headers: str):
    content: object = text
    if image:
        png = base64.b64encode(image_bytes(64, 64, seed=1)).decode()
        content = [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        ]
    body = {"model": "obs", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply


def scrape(url: str) -> dict[str, list]:
    text = httpx.get(f"{url}/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def llm_sample(families: dict[str, list], family: str, sample: str = "", **labels: str):
    for s in families.get(family, []):
        if s.name == (sample or family) and s.labels.get("role") == "llm":
            if all(s.labels.get(k) == v for k, v in labels.items()):
                return s
    return None


def test_metrics_show_every_replicas_kv_and_queue_figures(deployment):
    url, _, _ = deployment
    chat(url)
    deadline = time.monotonic() + 10
    roles = {"llm", "vision_encoder", "gateway"}
    while True:  # figures arrive with each replica's next heartbeat
        families = scrape(url)
        steps = llm_sample(
            families, "omniflow_engine_step_seconds", "omniflow_engine_step_seconds_count"
        )
        seen = {s.labels["role"] for s in families.get("omniflow_replica_queue_depth", [])}
        if (steps is not None and steps.value > 0 and seen >= roles) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert steps is not None and steps.value > 0, sorted(families)
    assert steps.labels["replica"] == "0"
    used = llm_sample(families, "omniflow_kv_pages_used", tier="device")
    free = llm_sample(families, "omniflow_kv_pages_free", tier="device")
    assert used is not None and free is not None and free.value > 0
    for gauge in ("omniflow_engine_running_requests", "omniflow_engine_waiting_requests"):
        assert llm_sample(families, gauge) is not None, gauge
    for counter in ("omniflow_engine_preemptions", "omniflow_engine_prefix_hit_tokens"):
        assert llm_sample(families, counter, counter + "_total") is not None, counter
    depth = families["omniflow_replica_queue_depth"]
    assert {s.labels["role"] for s in depth} >= roles
    served = llm_sample(families, "omniflow_replica_served", "omniflow_replica_served_total")
    assert served is not None and served.value >= 1


def test_metrics_show_a_model_roles_thread_figures(deployment):
    """Not only the llm: the vision encoder's model-thread figures, after an image."""
    url, _, _ = deployment

    def compute_count(families: dict[str, list]) -> float:
        for s in families.get("omniflow_model_compute_seconds", []):
            if s.name.endswith("_count") and s.labels.get("role") == "vision_encoder":
                assert s.labels["replica"] == "0"
                return s.value
        return -1.0

    def served_count(families: dict[str, list]) -> float:
        served = [
            s
            for s in families.get("omniflow_replica_served", [])
            if s.name.endswith("_total") and s.labels["role"] == "vision_encoder"
        ]
        return served[0].value if served else -1.0

    before = compute_count(scrape(url))
    chat(url, text="what is this", image=True)
    deadline = time.monotonic() + 10
    while True:  # figures arrive with the encoder's next heartbeat
        families = scrape(url)
        after = compute_count(families)
        # A beat may fall between the model's call and the request's end (served).
        if (after > max(before, 0) and served_count(families) >= 1) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert after > max(before, 0), (before, after)
    seconds = [
        s
        for s in families["omniflow_model_compute_seconds"]
        if s.name.endswith("_sum") and s.labels["role"] == "vision_encoder"
    ]
    assert seconds and seconds[0].value > 0
    for gauge in ("omniflow_model_running_calls", "omniflow_model_waiting_calls"):
        roles = {s.labels["role"]: s.value for s in families[gauge]}
        assert roles.get("vision_encoder") == 0, (gauge, roles)  # idle again
    assert served_count(families) >= 1


TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def json_lines(path: Path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]  # every line one JSON object
    for line in parsed:
        assert TS.match(line["ts"]), line
    return parsed


def test_logs_are_json_with_a_banner_per_replica_and_an_access_line(deployment):
    url, run_dir, _ = deployment
    reply = chat(url, **{"x-request-id": "req-from-test-1"})
    assert reply.headers["x-request-id"] == "req-from-test-1"
    logs = run_dir / "logs"
    assert {p.name for p in logs.glob("*.log")} == {
        "gateway-0.log",
        "llm-0.log",
        "vision_encoder-0.log",
    }
    for path in logs.glob("*.log"):
        banners = [line for line in json_lines(path) if line["msg"].endswith(" loaded")]
        assert len(banners) == 1, (path, banners)
        assert banners[0]["actor"] == path.stem.replace("-", "/")
        assert banners[0]["pid"] > 0 and banners[0]["setup_s"] >= 0
    (llm,) = [line for line in json_lines(logs / "llm-0.log") if line["msg"] == "llm/0 loaded"]
    assert llm["model"].endswith("/models/llm") and llm["dtype"] in ("float32", "bfloat16")
    assert llm["kv_pages"] > 0 and llm["kv_mib"] > 0 and llm["threads"] == 1
    assert llm["kernels"] and llm["device"] == "cpu" and llm["max_model_len"] > 0
    (vision,) = [line for line in json_lines(logs / "vision_encoder-0.log") if "setup_s" in line]
    assert vision["model"].endswith("/models/vision") and vision["threads"] == 1
    deadline = time.monotonic() + 5
    while True:  # the line is written as the response ends
        access = [
            line
            for line in json_lines(logs / "gateway-0.log")
            if line.get("request_id") == "req-from-test-1"
        ]
        if access or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(access) == 1, access
    (line,) = access
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions", 200)
    assert line["ms"] > 0 and line["logger"] == "omniflow.gateway.access"
    (ready,) = [s for s in json_lines(run_dir / "supervisor.log") if s["msg"].startswith("ready")]
    assert ready["actor"] == "supervisor" and "3 actors" in ready["msg"]


def wait_for_spans(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> list[dict]:
    deadline = time.monotonic() + 15
    while True:  # each process exports in batches (every 200 ms)
        spans = receiver.trace(trace_id)
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_a_traced_request_is_one_trace_with_a_span_per_role(deployment):
    url, _, receiver = deployment
    reply = chat(url, "what is this", image=True, traceparent=TRACEPARENT)
    assert reply.headers["traceparent"].split("-")[1] == TRACE_ID
    roles = {"gateway", "vision_encoder", "llm"}
    spans = wait_for_spans(receiver, TRACE_ID, roles)
    by_name = {s["name"]: s for s in spans}
    assert roles <= set(by_name), spans
    gateway, vision, llm = (by_name[r] for r in ("gateway", "vision_encoder", "llm"))
    assert gateway["parent"] == "00f067aa0ba902b7"  # the caller's span
    assert vision["parent"] == gateway["span_id"]
    assert llm["parent"] in (gateway["span_id"], vision["span_id"])
    assert gateway["attributes"]["http.response.status_code"] == 200
    assert llm["attributes"]["omniflow.compute_ms"] > 0
    assert gateway["start"] <= vision["start"] <= vision["end"] <= gateway["end"]
    waits = [s for s in spans if s["name"] == "queue"]
    assert all(w["parent"] in {vision["span_id"], llm["span_id"]} for w in waits)
    # Without a traceparent the gateway starts a trace of its own.
    fresh = chat(url).headers["traceparent"].split("-")[1]
    assert fresh != TRACE_ID and {"gateway", "llm"} <= {
        s["name"] for s in wait_for_spans(receiver, fresh, {"gateway", "llm"})
    }


def test_send_trace_prints_the_span_tree(deployment):
    _, run_dir, receiver = deployment
    proc = cli("send", "--run-dir", str(run_dir), "--text", "hi", "--max-tokens", "2", "--trace")
    lines = proc.stderr.splitlines()
    (head,) = [line for line in lines if line.startswith("trace ")]
    trace_id = head.split()[1]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id)
    client = next(line for line in lines if line.startswith("client "))
    assert any(re.match(r"^└─ llm/0 [0-9a-f]{16} \+", line) for line in lines), proc.stderr
    assert client.split()[1] and "compute" in proc.stderr
    spans = wait_for_spans(receiver, trace_id, {"llm"})
    assert [s["parent"] for s in spans if s["name"] == "llm"] == [client.split()[1]]
