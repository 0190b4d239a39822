"""The subset of a Hugging Face Llama/Qwen2 config.json that the decoder needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.models.config_keys import ConfigKeys

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: dict[str, Any] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def rope_theta(self) -> float:
        return float(self.rope.get("rope_theta", 10000.0))

    @property
    def rope_type(self) -> str:
        return str(self.rope.get("rope_type", self.rope.get("type", "default")))

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """The KV cache's (layers, kv heads, head_dim)."""
        return self.num_hidden_layers, self.num_key_value_heads, self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], file: str = "config.json") -> DecoderConfig:
        keys = ConfigKeys(raw, file)
        architectures = keys.get("architectures") or []
        architecture = architectures[0] if architectures else _architecture_from_model_type(raw)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise NotImplementedError(
                f"config.json architecture {architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        keys.silu()
        if architecture == "Qwen2ForCausalLM" and keys.get("use_sliding_window"):
            raise NotImplementedError("Qwen2 use_sliding_window=true: sliding-window attention")
        heads = keys.integer("num_attention_heads")
        hidden = keys.integer("hidden_size")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=keys.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=keys.integer("intermediate_size"),
            num_hidden_layers=keys.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=keys.integer("num_key_value_heads", heads, falsy=True),
            head_dim=keys.integer("head_dim", hidden // heads, falsy=True),
            rms_norm_eps=keys.number("rms_norm_eps", 1e-6),
            max_position_embeddings=keys.integer("max_position_embeddings", 2048),
            tie_word_embeddings=keys.flag("tie_word_embeddings"),
            qkv_bias=True if is_qwen2 else keys.flag("attention_bias"),
            o_bias=False if is_qwen2 else keys.flag("attention_bias"),
            mlp_bias=False if is_qwen2 else keys.flag("mlp_bias"),
            rope=_rope_parameters(raw),
            bos_token_id=keys.get("bos_token_id"),
            eos_token_ids=keys.eos_token_ids(),
            torch_dtype=keys.torch_dtype(),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> DecoderConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        return cls.from_dict(json.loads(config_file.read_text()), str(config_file))


def _architecture_from_model_type(raw: dict[str, Any]) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        raw.get("model_type", ""), str(raw.get("model_type"))
    )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge the transformers-5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    rope = dict(raw.get("rope_parameters") or {})
    rope.update(raw.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if (
        raw.get("partial_rotary_factor", 1.0) != 1.0
        or rope.get("partial_rotary_factor", 1.0) != 1.0
    ):
        raise NotImplementedError("partial_rotary_factor != 1: partial rotary embeddings")
    if rope["rope_type"] in ("llama3", "yarn"):
        rope.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 2048)),
        )
    return rope
