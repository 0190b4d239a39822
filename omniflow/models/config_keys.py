"""One reader for a checkpoint's config.json (the Llama/Qwen2, DeepSeek/LongCat MLA and
HunyuanImage-3 configs' ``from_dict``): each key read with its type, so a key that is
missing where required, or of the wrong type, is a ValueError naming the key and the file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_REQUIRED: Any = object()


class ConfigKeys:
    def __init__(self, raw: dict[str, Any], file: str = "config.json") -> None:
        if not isinstance(raw, dict):
            raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
        self.raw, self.file = raw, file

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def integer(self, key: str, default: Any = _REQUIRED, *, falsy: bool = False) -> int:
        """``raw[key]`` as an int; ``default`` where it is absent (or, with ``falsy``, any
        false value such as null or 0); required without a default."""
        return self._read(key, int, default, falsy)

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        return self._read(key, float, default, False)

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.raw.get(key, default))

    def optional_int(self, key: str) -> int | None:
        return None if self.raw.get(key) is None else self.integer(key)

    def silu(self) -> None:
        """The decoders' MLPs are SwiGLU: refuse another activation by name."""
        if self.raw.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"hidden_act {self.raw['hidden_act']!r}: only 'silu' is supported"
            )

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        if isinstance(eos, list):
            return tuple(eos)
        return () if eos is None else (self.integer("eos_token_id"),)

    def torch_dtype(self) -> str:
        return str(self.raw.get("torch_dtype") or self.raw.get("dtype") or "float32")

    def _read(self, key: str, kind: Callable[[Any], T], default: Any, falsy: bool) -> T:
        value = self.raw.get(key, _REQUIRED)
        if value is _REQUIRED or (falsy and not value):
            if default is _REQUIRED:
                raise ValueError(f"{self.file}: {key}: missing (a required key)")
            value = default
        try:
            return kind(value)
        except (TypeError, ValueError):
            name = getattr(kind, "__name__", str(kind))
            raise ValueError(f"{self.file}: {key} = {value!r}: expected {name}") from None
