"""The HunyuanImage-3 pipeline end to end: ar, diffusion and vae_decoder as real processes.

One deployment of configs/hunyuan_image3.toml (tiny random weights, built on first start)
serves every test here: one weight copy across ar and diffusion (checked in each process's
/proc/<pid>/maps), no prompt row forwarded by diffusion, t2i and ti2i through the CLI, the
same seed giving the same PNG bytes, bad input refused by field, and a killed ar leaving no
lent page behind.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from PIL import Image

import omniflow
from omniflow.control.discovery import list_actors, open_registry
from omniflow.memory import PagePool
from omniflow.memory.mappings import mapping_at
from tests.helpers import cli
from tests.roles.media import image_bytes

ROOT = Path(__file__).resolve().parents[2]
NAME = "hunyuan_image3"
SMALL = {"size": "64x64", "steps": 3, "seed": 1}  # 16 image tokens: quick on a small CPU
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    work = tmp_path_factory.mktemp("hunyuan")
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    (work / "configs").mkdir()
    toml = (ROOT / "configs" / "hunyuan_image3.toml").read_text()
    # No HTTP gateway here: the port may be taken by another deployment on this host.
    toml = toml[: toml.index("[gateway]")]
    # One denoising loop at a time: a second request waits in diffusion's queue.
    toml = toml.replace("[roles.diffusion]\n", "[roles.diffusion]\nmax_concurrency = 1\n")
    (work / "configs" / "hunyuan_image3.toml").write_text(toml)
    (work / "cube.png").write_bytes(image_bytes(80, 48, seed=4))
    cli("up", "configs/hunyuan_image3.toml", "--detach", cwd=work)
    state = omniflow.runtime.find_deployment(NAME)
    yield state, work
    cli("down", "--name", NAME, check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def call(state, inputs, **kwargs):
    async def run():
        conn = await omniflow.connect(run_dir=state["run_dir"])
        try:
            return await conn.call(inputs, timeout=120, **kwargs)
        finally:
            await conn.close()

    return asyncio.run(run())


async def records_now(state):
    registry = open_registry(state["registry"])
    try:
        return {r.role: r for r in await list_actors(registry, state["name"])}
    finally:
        await registry.close()


def records(state):
    return asyncio.run(records_now(state))


def pool_stats(state):
    pool = PagePool.attach(state["pool"])
    try:
        return pool.stats()
    finally:
        pool.close()


def png_of(outputs):
    [image] = [o for o in outputs if o.role == "vae_decoder"]
    return image.data["image"]


def test_ar_and_diffusion_map_one_copy_of_the_backbone(hunyuan):
    state, _ = hunyuan
    found = records(state)
    ar, diffusion = found["ar"], found["diffusion"]
    assert ar.pid != diffusion.pid
    mine, theirs = ar.meta["weights"], diffusion.meta["weights"]
    assert len(mine["tensors"]) == len(theirs["tensors"]) > 10
    assert mine["loaded"] != theirs["loaded"]  # one loaded the copy, the other mapped it
    # Every backbone tensor of either process resolves, in the kernel's own maps, to the
    # same file and offset: the same physical pages.
    for (a, nbytes), (b, _) in zip(mine["tensors"], theirs["tensors"], strict=True):
        first, second = mapping_at(a, ar.pid), mapping_at(b, diffusion.pid)
        assert first.path.startswith("/dev/shm/") and first == second
        assert mapping_at(a + nbytes - 1, ar.pid) == mapping_at(b + nbytes - 1, diffusion.pid)


def test_diffusion_forwards_no_prompt_row(hunyuan):
    state, _ = hunyuan
    outputs, result = call(state, {"text": "a red cube on a table " * 8}, params=SMALL)
    usage = result.usage
    assert usage["diffusion_prompt_rows_forwarded"] == 0
    # Each step: the <timestep> row and 16 image rows, cond and uncond in one forward.
    assert usage["diffusion_rows_forwarded"] == SMALL["steps"] * 2 * (1 + 16)
    assert usage["ar_rows_forwarded"] >= 2 * 40  # ar computed both contexts
    steps = [o.data["progress"] for o in outputs if "progress" in o.data]
    assert steps == [{"step": k, "steps": 3} for k in (1, 2, 3)]
    assert Image.open(io.BytesIO(png_of(outputs))).size == (64, 64)
    # The role's own running count says the same (published with its heartbeat).
    until = time.monotonic() + 15
    while (stats := records(state)["diffusion"].meta["stats"])["requests"] == 0:
        assert time.monotonic() < until, stats
        time.sleep(0.2)
    assert stats["rows_forwarded"] > 0 and stats["prompt_rows_forwarded"] == 0


def test_same_seed_same_png_bytes(hunyuan):
    state, _ = hunyuan
    first = png_of(call(state, {"text": "a red cube"}, params=SMALL)[0])
    second = png_of(call(state, {"text": "a red cube"}, params=SMALL)[0])
    other = png_of(call(state, {"text": "a red cube"}, params={**SMALL, "seed": 2})[0])
    assert first == second
    assert other != first


def test_t2i_and_ti2i_through_the_cli(hunyuan):
    state, work = hunyuan
    out = work / "t2i"
    proc = cli(
        "send", "--name", NAME, "--text", "a red cube", "--want", "image", "--out", str(out),
        "--param", "steps=4", cwd=work,
    )  # fmt: skip
    [png] = list(out.glob("*.png"))
    image = Image.open(png)
    assert image.format == "PNG" and image.width % 16 == 0 and image.height % 16 == 0
    assert "denoising step 4/4" in proc.stderr
    out = work / "ti2i"
    cli(
        "send", "--name", NAME, "--text", "make it blue", "--image", "cube.png", "--want",
        "image", "--out", str(out), "--param", "size=48x32", "--param", "steps=2", cwd=work,
    )  # fmt: skip
    [png] = list(out.glob("*.png"))
    assert Image.open(png).size == (48, 32)


def test_a_condition_image_enters_the_context(hunyuan):
    state, work = hunyuan
    plain = call(state, {"text": "make it blue"}, params=SMALL)[1]
    image = (work / "cube.png").read_bytes()
    outputs, edited = call(state, {"text": "make it blue", "image": image}, params=SMALL)
    # ViT rows and the clean latent's rows sit in the context ar computed and lent.
    assert edited.usage["prompt_tokens"] > plain.usage["prompt_tokens"] + 16
    assert edited.usage["diffusion_prompt_rows_forwarded"] == 0
    assert Image.open(io.BytesIO(png_of(outputs))).size == (64, 64)


@pytest.mark.parametrize(
    "params, inputs, field",
    [
        ({"steps": 0}, {}, "params.steps"),
        ({"steps": 10_000}, {}, "params.steps"),
        ({"cfg_scale": -1.0}, {}, "params.cfg_scale"),
        ({"size": "7x13"}, {}, "params.size"),
        ({"size": "4096x4096"}, {}, "params.size"),
        ({}, {"image": b"certainly not an image"}, "image"),
    ],
)
def test_bad_input_is_refused_by_field_and_the_deployment_serves_on(hunyuan, params, inputs, field):
    state, _ = hunyuan
    with pytest.raises(omniflow.RequestFailed) as info:
        call(state, {"text": "a red cube", **inputs}, params={**SMALL, **params})
    assert info.value.code == "bad_request"
    assert info.value.detail.startswith(f"{field}:"), info.value.detail
    outputs, _ = call(state, {"text": "a red cube"}, params=SMALL)
    assert png_of(outputs).startswith(b"\x89PNG")


def test_a_killed_ar_leaves_no_lent_page_behind(hunyuan):
    state, _ = hunyuan
    call(state, {"text": "warm"}, params=SMALL)
    before = settled(state)
    ar = records(state)["ar"]

    async def run():
        conn = await omniflow.connect(run_dir=state["run_dir"])
        try:
            params = {**SMALL, "steps": 60, "size": "128x128"}
            events = []
            async for event in conn.stream({"text": "a long one"}, params=params, timeout=120):
                events.append(event)
                if len(events) == 1:  # diffusion holds the lease now: ar dies under it
                    # once its record shows it handed the request on: a replica's holding
                    # is published with its heartbeat, and a client ends what a dead
                    # replica's last record still held (runtime/migration.py)
                    while (await records_now(state))["ar"].holding:
                        await asyncio.sleep(0.02)
                    os.kill(ar.pid, signal.SIGKILL)
            return events
        finally:
            await conn.close()

    events = asyncio.run(run())
    assert events[0].data["progress"]["step"] == 1
    # The borrower's refs kept the lent KV readable: the request finished.
    assert png_of(events[:-1]).startswith(b"\x89PNG")
    until = time.monotonic() + 60
    while (found := records(state).get("ar")) is None or found.pid == ar.pid:
        assert time.monotonic() < until, "ar was not restarted"
        time.sleep(0.2)
    call(state, {"text": "after"}, params=SMALL)
    assert settled(state) == before  # the dead lender's K/V blocks and tails all went back


def test_a_request_that_expires_in_diffusions_queue_gives_its_leases_back(hunyuan):
    state, _ = hunyuan
    call(state, {"text": "warm"}, params=SMALL)
    before = settled(state)

    async def run():
        conn = await omniflow.connect(run_dir=state["run_dir"])
        try:
            params = {**SMALL, "steps": 200, "size": "256x256"}
            stream = conn.stream({"text": "a long one"}, params=params, timeout=120)
            first = await anext(stream)  # diffusion's one slot is taken now
            with pytest.raises(omniflow.RequestFailed) as info:
                await conn.call({"text": "a short one"}, params=SMALL, timeout=1.0)
            rest = [event async for event in stream]
            return first, rest, info.value
        finally:
            await conn.close()

    first, rest, failure = asyncio.run(run())
    assert first.data["progress"]["step"] == 1
    assert png_of(rest[:-1]).startswith(b"\x89PNG")
    # The short one's leases reached diffusion, which never ran it: it gave them back.
    assert failure.code == "deadline"
    assert settled(state) == before


def test_a_request_past_its_deadline_mid_loop_gives_its_leases_back(hunyuan):
    state, _ = hunyuan
    call(state, {"text": "warm"}, params=SMALL)
    before = settled(state)
    params = {**SMALL, "steps": 200, "size": "256x256"}

    # A deadline a quarter of the way through the 200 steps, from a step's time measured
    # here (two requests' difference: the fixed costs, the VAE's decode among them, cancel):
    # the request is denoising when it passes, however fast this machine is today.
    def timed(steps):
        started = time.monotonic()
        call(state, {"text": "timing"}, params={**params, "steps": steps})
        return time.monotonic() - started

    fixed_and_5, with_25 = timed(5), timed(25)
    per_step = max(0.0, with_25 - fixed_and_5) / 20
    deadline_s = max(0.5, fixed_and_5 + 45 * per_step)

    async def run():
        conn = await omniflow.connect(run_dir=state["run_dir"])
        try:
            seen = []
            with pytest.raises(omniflow.RequestFailed) as info:
                async for event in conn.stream(
                    {"text": "too slow"}, params=params, timeout=deadline_s
                ):
                    seen.append(event)
            return seen, info.value
        finally:
            await conn.close()

    seen, failure = asyncio.run(run())
    assert seen and all("progress" in event.data for event in seen)  # it was denoising
    assert failure.code == "deadline"
    assert settled(state) == before
    outputs, _ = call(state, {"text": "a red cube"}, params=SMALL)  # and it serves on
    assert png_of(outputs).startswith(b"\x89PNG")


def settled(state, timeout: float = 20.0):
    """Pool usage once no lease is in flight (ar unlocks returned pages within a beat)."""
    until = time.monotonic() + timeout
    last = None
    while True:
        stats = pool_stats(state)
        now = (stats.used_pages, stats.live_leases)
        if now == last:
            return now
        assert time.monotonic() < until, now
        last = now
        time.sleep(0.5)
