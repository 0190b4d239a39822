"""The sequence template against the release's: `reference_*` below transcribe
``hunyuan_image_3/tokenizer_wrapper.py`` (apply_chat_template -> apply_general_template ->
encode_general -> encode_sequence, with batch_gen_infer's uncond pass) and
``hunyuan.py``'s ``build_2d_rope`` / ``build_batch_rope_image_info`` as the release runs
them, section by section, on the tiny tokenizer."""

import itertools

import pytest
import torch

from omniflow.models.hunyuan_image3.template import ConditionImage, SequenceTemplate
from omniflow.models.hunyuan_image3.tokens import ImageTokens
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3
from omniflow.models.tiny.tokenizer import BOS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    folder = build_tiny_hunyuan_image3(tmp_path_factory.mktemp("template") / "tiny", seed=0)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def encoder(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


# --- the release, transcribed ----------------------------------------------------------------


def reference_sections(messages, template, bot_task, add_assistant_prefix, base):
    """apply_general_template: messages -> sections (type, text | image info, uncond)."""
    instruct = template == "instruct"
    answer = ("<answer>", "</answer>") if instruct else ("", "")
    sys_suffix, user, user_suffix, bot, bot_suffix = (
        ("\n\n", "User: ", "\n\n", "Assistant: ", "\n\n") if instruct else ("",) * 5
    )
    sections, i, final = [], 0, None

    def run(role, prefix, suffix, a_pre="", a_suf=""):
        nonlocal i
        sub = []
        while i < len(messages) and messages[i]["role"] == role:
            m = messages[i]
            if m["type"] == "text" and role == "system":
                sub.append(("text", m["content"], False))
            elif m["type"] == "text" and role == "assistant":
                sub += reference_cot(m["content"])
            elif m["type"] == "text":
                sub.append(("text", f"{a_pre}{m['content']}{a_suf}", True))
            elif m["type"] == "gen_image":
                sub += [("text", a_pre, False), ("gen_image", m["content"], False)]
                sub.append(("text", a_suf, False))
            else:
                sub.append(("joint_image", m["content"], False))
            i += 1
        if sub:
            sub = [("text", prefix, False), *sub, ("text", suffix, False)]
        return sub

    while i < len(messages):
        for role, pre, suf, extra in (
            ("system", "", sys_suffix, ()),
            ("user", user, user_suffix, ()),
            ("assistant", bot, bot_suffix, answer),
        ):
            sub = run(role, pre, suf, *extra)
            sections += sub
            final = role if sub else final
    if add_assistant_prefix:
        prefix = bot
        if final == "assistant":
            prefix = ""
            if sections and sections[-1][:2] == ("text", bot_suffix):
                sections = sections[:-1]
        text = {
            "recaption": f"{prefix}<recaption>",
            "img_ratio": f"{prefix}{answer[0]}<boi><img_size_{base}>",
        }[bot_task]
        sections.append(("text", text, False))
    return sections


def reference_cot(text):
    """get_cot_sections for one <recaption> ... </recaption>."""
    before, rest = text.split("<recaption>")
    body, after = rest.split("</recaption>")
    return [
        ("text", before, True),
        ("text", "<recaption>", False),
        ("text", body, True),
        ("text", "</recaption>", False),
        ("text", after, True),
    ]


def reference_encode(tokenizer, sections, uncond):
    """encode_general + encode_sequence (add_bos, no eos, no pad): ids, gen timestep index,
    and the image slices with their grids (build_batch_rope_image_info)."""
    enc, special = encoder(tokenizer), tokenizer.token_to_id
    ids, images, gen_timestep = [special(BOS)], [], None
    for kind, content, droppable in sections:
        if kind == "text":
            text = enc(content) if content else []
            ids += [special("<cfg>")] * len(text) if uncond and droppable else text
            continue
        info = content
        ids += [special("<boi>"), special(f"<img_size_{info['base']}>")]
        ids += [special(f"<img_ratio_{info['ratio']}>")]
        if kind == "gen_image":
            gen_timestep = len(ids)
        ids.append(special("<timestep>"))
        images.append((len(ids), info["grid"]))
        ids += [special("<img>")] * (info["grid"][0] * info["grid"][1])
        if kind == "joint_image":
            ids.append(special("<joint_img_sep>"))
            images.append((len(ids), info["vit_grid"]))
            ids += [special("<img>")] * info["vit_tokens"]
        ids.append(special("<eoi>"))
    return ids, gen_timestep, images


def reference_rope_positions(seq_len, images):
    """build_2d_rope's (y, x) positions, float grids truncated as the release does."""
    ys, xs, last = [], [], 0
    for start, (h, w) in images:
        if last < start:
            ys.append(torch.arange(last, start))
            xs.append(torch.arange(last, start))
        by, bx = start + (w * h - h) / 2, start + (w * h - w) / 2
        gy = torch.linspace(by, by + h, h + 1, dtype=torch.float32)[:h]
        gx = torch.linspace(bx, bx + w, w + 1, dtype=torch.float32)[:w]
        grid = torch.stack(torch.meshgrid(gy, gx, indexing="ij")).reshape(2, -1)
        ys.append(grid[0])
        xs.append(grid[1])
        last = start + w * h
    ys.append(torch.arange(last, seq_len))
    xs.append(torch.arange(last, seq_len))
    return torch.stack((torch.cat(ys).long(), torch.cat(xs).long()), dim=1)[:seq_len]


def reference_messages(system, prompt, conditions, cot_text, gen):
    """apply_chat_template's message list of one prompt."""
    messages = [dict(role="system", type="text", content=system)] if system else []
    messages += [dict(role="user", type="joint_image", content=c) for c in conditions]
    messages.append(dict(role="user", type="text", content=prompt))
    if cot_text is not None:
        messages.append(dict(role="assistant", type="text", content=cot_text))
    if gen is not None:
        messages.append(dict(role="assistant", type="gen_image", content=gen))
    return messages


# --- the comparison ----------------------------------------------------------------------------

PROMPT = "a red cube on a table"
COT = " a small red cube, studio light"
CONDITIONS = [
    ConditionImage(256, 16, (4, 4), (4, 4), 16),
    ConditionImage(256, 3, (2, 6), (3, 5), 16),  # a ViT span with one pad after its grid
]


def info(image):
    return dict(
        base=image.base_size,
        ratio=image.ratio,
        grid=image.grid,
        vit_grid=image.vit_grid,
        vit_tokens=image.vit_tokens,
    )


CASES = list(
    itertools.product(("pretrain", "instruct"), (None, "Draw what is asked."), (0, 1, 2), (0, 1))
)


@pytest.mark.parametrize(("template", "system", "images", "cot"), CASES)
def test_image_sequence_is_the_releases(tokenizer, template, system, images, cot):
    enc = encoder(tokenizer)
    ours = SequenceTemplate(ImageTokens.from_tokenizer(tokenizer), enc, template, system)
    conditions = CONDITIONS[:images]
    cot_ids = enc(COT) if cot else None
    cot_text = f"<recaption>{COT}</recaption>" if cot else None
    gen = dict(base=256, ratio=20, grid=(3, 5))
    messages = reference_messages(system, PROMPT, [info(c) for c in conditions], cot_text, gen)
    sections = reference_sections(messages, template, "image", False, 256)
    for uncond in (False, True):
        layout = ours.image_sequence(enc(PROMPT), 256, 20, (3, 5), conditions, cot_ids, uncond)
        ids, timestep, images_ = reference_encode(tokenizer, sections, uncond)
        assert layout.ids == ids
        assert layout.timestep == timestep
        assert [tuple(s) for s in layout.images] == images_
        positions = reference_rope_positions(len(ids), images_)
        assert torch.equal(layout.positions(), positions)
        # The context (what the block steps attend to) is the sequence up to the ratio.
        context = ours.context(enc(PROMPT), 256, 20, (3, 5), conditions, cot_ids, uncond)
        assert context.ids == ids[:timestep]
        assert torch.equal(context.positions(), positions[:timestep])


@pytest.mark.parametrize(("template", "system", "images", "cot"), CASES)
def test_the_ar_steps_prompts_are_the_releases(tokenizer, template, system, images, cot):
    """The ratio step's prompt (bot_task img_ratio) is the context less its ratio token; the
    recaption step's (bot_task recaption) ends in <recaption>."""
    enc = encoder(tokenizer)
    ours = SequenceTemplate(ImageTokens.from_tokenizer(tokenizer), enc, template, system)
    conditions = CONDITIONS[:images]
    cot_ids = enc(COT) if cot else None
    cot_text = f"<recaption>{COT}</recaption>" if cot else None
    conds = [info(c) for c in conditions]
    messages = reference_messages(system, PROMPT, conds, cot_text, None)
    sections = reference_sections(messages, template, "img_ratio", True, 256)
    ids, _, images_ = reference_encode(tokenizer, sections, False)
    context = ours.context(enc(PROMPT), 256, 7, (3, 5), conditions, cot_ids)
    assert context.ids[:-1] == ids
    assert [tuple(s) for s in context.images] == images_
    if cot:
        return
    sections = reference_sections(messages, template, "recaption", True, 256)
    ids, _, images_ = reference_encode(tokenizer, sections, False)
    recaption = ours.recaption_prompt(enc(PROMPT), conditions)
    assert recaption.ids == ids
    assert torch.equal(recaption.positions(), reference_rope_positions(len(ids), images_))


def test_an_unknown_template_is_refused(tokenizer):
    with pytest.raises(ValueError, match="sequence_template 'chat'"):
        SequenceTemplate(ImageTokens.from_tokenizer(tokenizer), encoder(tokenizer), "chat")
