"""Prompts from a checkpoint's chat template, rendered in a sandboxed Jinja environment.

The template comes from the llm's ``chat_template`` option (the template text, or a path to
a file), else the checkpoint's ``chat_template.jinja``, else ``chat_template`` in its
``tokenizer_config.json`` (as transformers reads them). It renders as transformers renders
it: jinja2's ``ImmutableSandboxedEnvironment`` (a template cannot reach Python), with
``messages``, ``add_generation_prompt``, ``bos_token``/``eos_token`` and ``raise_exception``.

Media parts go to the template as ``{"type": "image"}`` / ``{"type": "audio"}``; the template
writes its marker for each (``image_token`` / ``audio_token`` of tokenizer_config.json, by
default ``<image>`` / ``<audio>``), and the rendered text is cut at the markers: each becomes
that medium's embedding span. Assistant contents are rendered as sentinels and cut out too,
so the llm can put back the very token ids it generated (re-tokenizing a reply can differ,
and the prefix cache matches by ids).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from omniflow.models.tiny_tokenizer import TINY_CHAT_TEMPLATE

__all__ = ["ChatTemplate", "Piece", "TemplateError", "load_chat_template", "with_sentinels"]

# For checkpoints that ship no template: the one the tiny builders write.
DEFAULT_TEMPLATE = TINY_CHAT_TEMPLATE
_SENTINEL = "\ue000{}\ue001"  # private-use characters around an assistant message's index
_SENTINEL_RE = "\ue000\\d+\ue001"


class TemplateError(ValueError):
    """A template that fails to render, or puts a different number of media markers."""


class Piece(NamedTuple):
    """One piece of a rendered prompt: ``kind`` "text" (``text``), "image"/"audio" (a media
    marker, the ``nth`` of its kind) or "reply" (the ``nth`` message's content)."""

    kind: str
    text: str = ""
    nth: int = 0


def load_chat_template(folder: str | Path, override: str = "") -> tuple[str, dict[str, Any]]:
    """(template text, tokenizer_config.json as a dict) of a checkpoint folder."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if override:
        path = Path(override)
        if "{" not in override and path.is_file():
            return path.read_text(), config
        return override, config
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(), config
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return (template if isinstance(template, str) and template else DEFAULT_TEMPLATE), config


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template: {e.message} (line {e.lineno})") from None


def _token(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """A compiled chat template and the markers it writes for media."""

    def __init__(self, source: str, config: dict[str, Any] | None = None) -> None:
        config = config or {}
        self.source = source
        self.template = _compile(source)
        self.bos_token = _token(config.get("bos_token"))
        self.eos_token = _token(config.get("eos_token"))
        self.markers = {
            "image": _token(config.get("image_token")) or "<image>",
            "audio": _token(config.get("audio_token")) or "<audio>",
        }
        alternatives = [re.escape(m) for m in self.markers.values()] + [_SENTINEL_RE]
        self._cut = re.compile("(" + "|".join(alternatives) + ")")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (media parts as ``{"type": kind}``)."""
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None

    def pieces(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[Piece]:
        """The rendered prompt cut into text, media markers and assistant replies."""
        rendered = self.render(with_sentinels(messages), add_generation_prompt)
        pieces = self.cut(rendered, messages)
        for kind in self.markers:
            count = sum(p.kind == kind for p in pieces)
            given = sum(
                1
                for m in messages
                if isinstance(m.get("content"), list)
                for p in m["content"]
                if isinstance(p, dict) and p.get("type") == kind
            )
            if given != count:
                raise TemplateError(
                    f"the chat template wrote {count} {kind} marker(s) "
                    f"({self.markers[kind]!r}) for {given} {kind} part(s)"
                )
        return pieces

    def cut(self, text: str, messages: list[dict[str, Any]]) -> list[Piece]:
        """``text`` (rendered with ``with_sentinels(messages)``) cut into pieces."""
        pieces: list[Piece] = []
        counts = {"image": 0, "audio": 0}
        kinds = {marker: kind for kind, marker in self.markers.items()}
        for i, part in enumerate(self._cut.split(text)):
            if not part:
                continue
            if i % 2 == 0:
                pieces.append(Piece("text", part))
            elif part in kinds:
                kind = kinds[part]
                pieces.append(Piece(kind, nth=counts[kind]))
                counts[kind] += 1
            else:
                index = int(part[1:-1])
                pieces.append(Piece("reply", messages[index]["content"], index))
        return pieces


def with_sentinels(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages, each assistant text replaced by a sentinel naming its index."""
    return [
        {**m, "content": _SENTINEL.format(i)}
        if m.get("role") == "assistant" and isinstance(m.get("content"), str)
        else m
        for i, m in enumerate(messages)
    ]
