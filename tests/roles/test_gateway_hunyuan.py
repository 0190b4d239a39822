"""The gateway in front of the HunyuanImage-3 deployment: /v1/images/generations through
the official openai client over loopback HTTP (size passed on as the roles read it; same
seed, same bytes; a bad size is a 400 naming it), and chat refuses what it cannot make."""

from __future__ import annotations

import base64
import io
import os
import tempfile
from pathlib import Path

import openai
import pytest
from PIL import Image

import omniflow
from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    work = tmp_path_factory.mktemp("hygw")
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    text = (ROOT / "configs" / "hunyuan_image3.toml").read_text()
    text = text.replace('name = "hunyuan_image3"', 'name = "hygw"')
    (work / "hygw.toml").write_text(text.replace("models/", str(work / "models") + "/"))
    cli("up", "hygw.toml", "--detach", "--port", "0", cwd=work)
    state = omniflow.runtime.find_deployment("hygw")
    url = (Path(state["run_dir"]) / "gateway.url").read_text().strip()
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    cli("down", "--name", "hygw", check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def generate(client, **kwargs):
    return client.images.generate(
        model="hygw", prompt="a red cube", response_format="b64_json", **kwargs
    )


def test_images_generations_take_the_size_and_repeat_a_seed(client):
    steps = {"seed": 5, "num_inference_steps": 2, "guidance_scale": 2.0}
    first = generate(client, size="256x128", extra_body=steps)
    again = generate(client, size="256x128", extra_body=steps)
    png = base64.b64decode(first.data[0].b64_json)
    assert Image.open(io.BytesIO(png)).size == (256, 128)
    assert png == base64.b64decode(again.data[0].b64_json)
    two = generate(client, size="auto", n=2, extra_body=steps)  # the AR step picks a ratio
    assert len(two.data) == 2 and two.data[0].b64_json != two.data[1].b64_json


def test_a_bad_size_is_a_400_naming_it_and_chat_makes_no_text(client):
    with pytest.raises(openai.BadRequestError) as bad:
        generate(client, size="7x13")
    assert "size" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as text:
        client.chat.completions.create(
            model="hygw", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "makes no text" in str(text.value)
    assert generate(client, size="128x128", extra_body={"num_inference_steps": 1}).data


def test_an_image_edit_is_conditioned_on_the_image(client):
    from tests.roles.media import image_bytes

    steps = {"seed": 5, "num_inference_steps": 2}

    def edit(seed_of_image: int):
        source = ("in.png", image_bytes(128, 128, seed=seed_of_image), "image/png")
        return client.images.edit(
            model="hygw", image=source, prompt="make it blue", size="128x128", extra_body=steps
        )

    one, other = edit(1), edit(2)
    png = base64.b64decode(one.data[0].b64_json)
    assert Image.open(io.BytesIO(png)).size == (128, 128)
    assert png != base64.b64decode(other.data[0].b64_json)  # the input image matters
    with pytest.raises(openai.BadRequestError) as masked:
        client.images.edit(
            model="hygw",
            image=("in.png", image_bytes(64, 64, seed=1), "image/png"),
            mask=("m.png", image_bytes(64, 64, seed=2), "image/png"),
            prompt="x",
        )
    assert masked.value.body["param"] == "mask"


def test_metrics_show_each_hunyuan_roles_engine_and_model_figures(client):
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    generate(client, size="256x256")
    url = str(client.base_url).rstrip("/").removesuffix("/v1")

    def samples(name: str) -> dict[str, float]:
        text = httpx.get(f"{url}/metrics").text
        return {
            s.labels["role"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name and s.labels.get("replica") == "0"
        }

    deadline = time.monotonic() + 10
    while True:  # figures arrive with each replica's next heartbeat
        computed = samples("omniflow_model_compute_seconds_count")
        if computed.get("vae_decoder", 0) > 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert computed.get("vae_decoder", 0) > 1, computed  # its warm-up, then this image
    steps = samples("omniflow_engine_step_seconds_count")
    assert steps.get("ar", 0) > 0 and steps.get("diffusion", 0) > 0, steps
    assert {"ar", "diffusion"} <= set(samples("omniflow_kv_pages_free"))
