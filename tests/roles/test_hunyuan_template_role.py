"""The ar role lays prompts out by the release's sequence template: a real ar process (its
own weights, nothing lent) over the tiny folder, with the instruct template, a system
prompt and a recaption; the contexts it sends on are SequenceTemplate's (which
tests/models/test_hunyuan_template.py checks against the release's builder)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import tomllib
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import omniflow
from omniflow.models.hunyuan_image3.config import generation_template
from omniflow.models.hunyuan_image3.template import SequenceTemplate
from omniflow.models.hunyuan_image3.tokens import ImageTokens
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3
from omniflow.runtime.config import parse

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "Draw exactly what is asked."


def ar_alone(model: Path, **options):
    raw = tomllib.loads((ROOT / "configs" / "hunyuan_image3.toml").read_text())
    raw.pop("gateway", None)
    raw.pop("resources", None)
    raw["name"] = "hunyuan_template_test"
    ar = raw["roles"]["ar"]
    ar["options"] |= {"model_path": str(model), "share_weights": False, "lend_kv": False}
    ar["options"] |= options
    raw["roles"] = {"ar": ar}
    raw["graph"] = {"edges": [{"from": "input", "to": "ar"}]}
    return parse(raw)


@pytest.mark.slow
def test_the_ar_role_sends_the_instruct_templates_contexts(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    model = build_tiny_hunyuan_image3(tmp_path / "model", seed=0)
    config = ar_alone(model, sequence_template="instruct", system_prompt=SYSTEM, recaption_tokens=4)
    text = "a red cube"

    async def run():
        async with omniflow.Runtime(config) as rt:
            return await rt.call({"text": text}, params={"size": "64x64"}, timeout=120)

    outputs, _ = asyncio.run(run())
    [out] = [o.data for o in outputs if o.role == "ar"]
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokens = ImageTokens.from_tokenizer(tokenizer)
    template = SequenceTemplate(
        tokens, lambda s: tokenizer.encode(s, add_special_tokens=False).ids, "instruct", SYSTEM
    )
    prompt = tokenizer.encode(text, add_special_tokens=False).ids
    ids = out["context_ids"]
    begin = ids.index(tokenizer.token_to_id("<recaption>"))
    end = ids.index(tokenizer.token_to_id("</recaption>"))
    cot = ids[begin + 1 : end]  # what the recaption step made (at most 4 tokens)
    assert len(cot) <= 4
    ratio = tokens.ratios.index(ids[-1])
    expected = template.context(prompt, 256, ratio, (1, 1), (), cot)
    assert ids == expected.ids
    uncond = template.context(prompt, 256, ratio, (1, 1), (), cot, uncond=True)
    assert out["uncond_ids"] == uncond.ids
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded.startswith(f"<s>{SYSTEM}\n\nUser: {text}\n\nAssistant: <recaption>")
    assert decoded.endswith("</recaption><answer><boi><img_size_256>" + f"<img_ratio_{ratio}>")


def test_the_template_comes_from_generation_config(tmp_path):
    model = build_tiny_hunyuan_image3(tmp_path / "model", seed=0)
    assert generation_template(model) == ("pretrain", None)  # the base release's
    assert generation_template(model, "instruct", "hi") == ("instruct", "hi")
    file = model / "generation_config.json"
    raw = json.loads(file.read_text())
    file.write_text(json.dumps(raw | {"sequence_template": "instruct"}))
    assert generation_template(model) == ("instruct", None)
    file.write_text(json.dumps(raw | {"use_system_prompt": "en_vanilla"}))
    with pytest.raises(ValueError, match="use_system_prompt 'en_vanilla'"):
        generation_template(model)
    assert generation_template(model, system_prompt="mine") == ("pretrain", "mine")
    file.write_text(json.dumps(raw | {"sequence_template": "chat"}))
    with pytest.raises(ValueError, match="sequence_template 'chat'"):
        generation_template(model)


def test_a_condition_image_is_scaled_to_cover_its_bucket_and_centre_cropped():
    import numpy as np
    from PIL import Image

    from omniflow.roles.hunyuan_ar import resize_and_crop

    pixels = np.random.default_rng(0).integers(0, 256, (50, 100, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    # Already as tall as the bucket: kept at its size, the middle 50 columns cut out.
    out = resize_and_crop(image, 50, 50)
    assert out.size == (50, 50) and np.array_equal(np.asarray(out), pixels[:, 25:75])
    # Scaled up to cover 64 x 128 (the height decides), then cropped to the width.
    out = resize_and_crop(image, 64, 128)
    assert out.size == (64, 128)
    tall = image.resize((256, 128), resample=Image.Resampling.LANCZOS)
    assert np.array_equal(np.asarray(out), np.asarray(tall)[:, 96:160])
