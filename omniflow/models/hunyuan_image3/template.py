"""HunyuanImage-3's sequence template: how the release lays a request out as tokens.

The release (``tokenizer_wrapper.py``: ``apply_chat_template``, ``apply_general_template``,
``encode_sequence``) builds a list of sections and encodes each text section on its own
(``add_special_tokens=False``), after one ``<bos>``. ``generation_config.json`` names the
template (``sequence_template``): ``pretrain`` (the base checkpoint's: no role words) or
``instruct``::

    pretrain: <bos> [system] [images] prompt [cot] <boi> <img_size_B> <img_ratio_r> <timestep> <img>*h*w <eoi>
    instruct: <bos> [system "\\n\\n"] "User: " [images] prompt "\\n\\n" "Assistant: " [cot]
              "<answer>" <boi> <img_size_B> <img_ratio_r> <timestep> <img>*h*w <eoi> "</answer>" "\\n\\n"

A condition image (ti2i) is ``<boi> <img_size_B> <img_ratio_r> <timestep> <img>*(vae h*w)
<joint_img_sep> <img>*(vit tokens) <eoi>``. A recaption ("cot") is ``<recaption> text
</recaption>``. The unconditional sequence (CFG) replaces the prompt's and the cot text's
tokens by as many ``<cfg>``; the system prompt, the role words and the images stay.

The AR steps run on prefixes of the same layout: the ratio step on the context up to
``<img_size_B>`` (it picks ``<img_ratio_r>``), the recaption step on the context up to
"Assistant: " + ``<recaption>`` (instruct) or up to ``<recaption>`` (pretrain).

Positions (the release's ``build_2d_rope``): every token at (i, i) but image spans (the
generated image, a condition image's VAE tokens and its ViT tokens), whose h x w grid
starting at L sits at rows L + (wh - h)/2 + y, columns L + (wh - w)/2 + x (rounded down);
tokens after a span's grid continue at their index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from omniflow.models.hunyuan_image3.tokens import ImageTokens, image_positions

TEMPLATES = ("pretrain", "instruct")
RECAPTION = ("<recaption>", "</recaption>")


@dataclass(frozen=True)
class ConditionImage:
    """A condition image's token counts: its VAE latent grid and its ViT patch grid (and
    the ViT span's length, the processor's max_num_patches: the grid's tokens, then pads)."""

    base_size: int
    ratio: int
    grid: tuple[int, int]
    vit_grid: tuple[int, int]
    vit_tokens: int


class Span(NamedTuple):
    start: int
    grid: tuple[int, int]


@dataclass
class Layout:
    """A sequence's ids and where its parts are."""

    ids: list[int] = field(default_factory=list)
    images: list[Span] = field(default_factory=list)  # every 2D span, in order
    timestep: int | None = None  # the generated image's <timestep>
    image: Span | None = None  # the generated image's <img> tokens
    cond_timesteps: list[int] = field(default_factory=list)
    cond_vae: list[Span] = field(default_factory=list)
    cond_vit: list[Span] = field(default_factory=list)
    joint: list[slice] = field(default_factory=list)  # VAE .. ViT tokens, attended in full

    def positions(self, length: int | None = None) -> torch.Tensor:
        """(y, x) [length, 2] of every token (build_2d_rope)."""
        return sequence_positions(self.images, len(self.ids) if length is None else length)


def sequence_positions(images: list[Span], length: int) -> torch.Tensor:
    index = torch.arange(length)
    out = torch.stack((index, index), dim=1)
    for start, (h, w) in images:
        end = min(start + h * w, length)
        out[start:end] = image_positions(start, (h, w))[: end - start]
    return out


class SequenceTemplate:
    """The release's template over a tokenizer's encode (text -> ids, no special tokens
    added) and its special-token ids."""

    def __init__(
        self,
        tokens: ImageTokens,
        encode: Callable[[str], list[int]],
        name: str = "pretrain",
        system_prompt: str | None = None,
    ):
        if name not in TEMPLATES:
            raise ValueError(f"sequence_template {name!r}: expected one of {list(TEMPLATES)}")
        self.tokens, self.encode, self.name = tokens, encode, name
        self.system_prompt = system_prompt or None
        instruct = name == "instruct"
        self.sep = "\n\n" if instruct else ""
        self.user = "User: " if instruct else ""
        self.bot = "Assistant: " if instruct else ""
        self.answer = ("<answer>", "</answer>") if instruct else ("", "")

    def _text(self, text: str) -> list[int]:
        return self.encode(text) if text else []

    def _head(
        self, layout: Layout, conditions: Sequence[ConditionImage], prompt: list[int]
    ) -> None:
        """<bos>, the system prompt, the user turn (images, then the prompt's ids)."""
        layout.ids.append(self.tokens.bos)
        if self.system_prompt:
            layout.ids += self._text(self.system_prompt) + self._text(self.sep)
        layout.ids += self._text(self.user)
        for image in conditions:
            self._condition(layout, image)
        layout.ids += prompt
        layout.ids += self._text(self.sep)

    def _condition(self, layout: Layout, image: ConditionImage) -> None:
        t = self.tokens
        layout.ids += [t.boi, t.sizes[image.base_size], t.ratios[image.ratio]]
        layout.cond_timesteps.append(len(layout.ids))
        layout.ids.append(t.timestep)
        vae = Span(len(layout.ids), image.grid)
        layout.ids += [t.img] * (image.grid[0] * image.grid[1]) + [t.joint_sep]
        vit = Span(len(layout.ids), image.vit_grid)
        layout.ids += [t.img] * image.vit_tokens
        layout.joint.append(slice(vae.start, len(layout.ids)))
        layout.ids.append(t.eoi)
        layout.cond_vae.append(vae)
        layout.cond_vit.append(vit)
        layout.images += [vae, vit]

    def _cot(self, cot: list[int] | None) -> list[int]:
        if cot is None:
            return []
        return [*self._text(RECAPTION[0]), *cot, *self._text(RECAPTION[1])]

    def image_sequence(
        self,
        prompt: list[int],
        base_size: int,
        ratio: int,
        grid: tuple[int, int],
        conditions: Sequence[ConditionImage] = (),
        cot: list[int] | None = None,
        uncond: bool = False,
    ) -> Layout:
        """The diffusion sequence (the release's gen_image mode). prompt: the prompt's ids
        (no <bos>); cot: a recaption's ids between <recaption> and </recaption>."""
        if base_size not in self.tokens.sizes:
            raise ValueError(
                f"base size {base_size}: the tokenizer has {sorted(self.tokens.sizes)}"
            )
        t = self.tokens
        if uncond:
            prompt = [t.cfg] * len(prompt)
            cot = None if cot is None else [t.cfg] * len(cot)
        layout = Layout()
        self._head(layout, conditions, prompt)
        layout.ids += self._text(self.bot) + self._cot(cot) + self._text(self.answer[0])
        layout.ids += [t.boi, t.sizes[base_size], t.ratios[ratio]]
        layout.timestep = len(layout.ids)
        layout.ids.append(t.timestep)
        layout.image = Span(len(layout.ids), grid)
        layout.images.append(layout.image)
        layout.ids += [t.img] * (grid[0] * grid[1]) + [t.eoi]
        layout.ids += self._text(self.answer[1]) + self._text(self.sep)
        return layout

    def context(self, *args, **kwargs) -> Layout:
        """image_sequence's prefix the block steps attend to: up to <img_ratio_r>."""
        layout = self.image_sequence(*args, **kwargs)
        assert layout.timestep is not None
        layout.ids = layout.ids[: layout.timestep]
        layout.images = [s for s in layout.images if s is not layout.image]
        layout.timestep = layout.image = None
        return layout

    def recaption_prompt(
        self, prompt: list[int], conditions: Sequence[ConditionImage] = ()
    ) -> Layout:
        """The recaption step's prompt: the user turn, then the assistant's <recaption>."""
        layout = Layout()
        self._head(layout, conditions, prompt)
        layout.ids += self._text(self.bot) + self._text(RECAPTION[0])
        return layout

    def recaption_stops(self) -> list[int]:
        """The ids that end a recaption: </recaption>, </answer> (the release's stops with
        <eos>)."""
        stops = []
        for token in (RECAPTION[1], "</answer>"):
            ids = self.encode(token)
            if len(ids) != 1:
                raise ValueError(f"the tokenizer lacks the special token {token!r}")
            stops += ids
        return stops
