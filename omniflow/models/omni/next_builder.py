"""A tiny random LongCat-Next checkpoint in the published layout, for tests and a fresh clone.

One folder: ``config.json`` (``model_type: longcat_next``, ``visual_config`` = Qwen2.5-VL vision
keys + ``vq_config``, ``audio_config`` = Whisper keys + ``vq_config``, the vocabulary offsets),
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` with the published
tensor names of the parts implemented here (vision tokenizer, audio tokenizer, the word
embedding, the LLM's LongCat-Flash decoder layers, final norm and ``lm_head``, the n-gram
embedding, the depth heads), ``cosy24k_vocoder/hift.pt`` (the HiFT vocoder's state dict, narrow), ``image_decoder/image_decoder.safetensors`` (the ViT decoder's
``image_decoder.*`` and the refiner's ``image_refiner.{base_transformer,vae,cond_proj}.*``), ``tokenizer.json`` (the tiny BPE + the multimodal specials),
``generation_config.json`` and ``tokenizer_config.json`` naming the multimodal special tokens at their published ids relative to ``text_vocab_size``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from omniflow.models.omni.checkpoint import write_checkpoint
from omniflow.models.omni.next_audio import PREFIX as AUDIO_PREFIX
from omniflow.models.omni.next_audio import NextAudioTokenizer
from omniflow.models.omni.next_audio_decoder import NextAudioDecoder
from omniflow.models.omni.next_codes import EMBED
from omniflow.models.omni.next_heads import NGRAM_PREFIX, NgramEmbedding, head_for
from omniflow.models.omni.next_hift import HIFT_PATH, tiny_hift_state
from omniflow.models.omni.next_image import WEIGHT_PATH, tiny_visual_decoder_config
from omniflow.models.omni.next_image_decoder import tiny_image_decoder_tensors
from omniflow.models.omni.next_vision import PREFIX as VISION_PREFIX
from omniflow.models.omni.next_vision import NextVisionTokenizer
from omniflow.models.tiny.builder import TinySpec
from omniflow.models.tiny.mla import mla_random_state_dict
from omniflow.models.tiny.tokenizer import (
    BOS,
    EOS,
    PAD,
    TINY_CHAT_TEMPLATE,
    build_tiny_tokenizer,
)

# Published ids minus text_vocab_size 131072 (vLLM's longcat_next.py defaults / config.json).
SPECIAL_TOKENS = {
    "<longcat_img_token_size>": 18,  # the anyres prefix: <longcat_img_token_size>h w</...>
    "</longcat_img_token_size>": 19,
    "<longcat_audio_start>": 31,
    "<longcat_audio_end>": 32,
    "<longcat_audio_pad>": 33,
    "<longcat_img_start>": 34,
    "<longcat_img_end>": 35,
    "<longcat_img_pad>": 36,
    "<longcat_img_newline>": 37,
    "<longcat_audio_delim>": 44,
    "<longcat_audiotext_start>": 48,
    "<longcat_audiotext_end>": 49,
    "<longcat_audiotext_pad>": 50,
    "<longcat_audiogen_start>": 51,
    "<longcat_audiogen_end>": 52,
}
N_SPECIAL = 53  # text_vocab_plus_multimodal_special_token_size - text_vocab_size


def tiny_config(
    hidden_size: int = 64, text_vocab_size: int = 512, quant_conv: bool = False
) -> dict[str, Any]:
    """A published-shaped config.json, every dimension tiny (``quant_conv``: the optional
    MLP before the visual codebooks)."""
    ids = {k: text_vocab_size + v for k, v in SPECIAL_TOKENS.items()}
    audio_sizes = [64, 32, 16, 8, 8, 8, 8, 8]  # published: 8192, 4096, 2048, 1024 x 5
    visual_sizes = [32] * 8  # published: 16384 x 8
    audio_offset = text_vocab_size + N_SPECIAL
    visual_offset = audio_offset + sum(audio_sizes)
    vocab = visual_offset + sum(visual_sizes)
    visual = _visual_config(ids, visual_sizes, quant_conv)
    return {
        "architectures": ["LongcatNextForCausalLM"],
        "model_type": "longcat_next",
        "hidden_size": hidden_size,
        "vocab_size": -(-vocab // 64) * 64,
        "text_vocab_size": text_vocab_size,
        "text_vocab_plus_multimodal_special_token_size": audio_offset,
        "audio_offset": audio_offset,
        "visual_offset": visual_offset,
        "visual_embedding_layer_intermediate_size": 2 * hidden_size,
        "visual_embedding_layer_hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "emb_neighbor_num": 4,
        "emb_split_num": 4,
        "ngram_vocab_size_ratio": 4,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        **_llm_config(hidden_size),
        "visual_config": visual,
        "audio_config": _audio_config(ids, audio_sizes),
        "visual_decoder_config": tiny_visual_decoder_config(visual["vq_config"]["codebook_dim"]),
    }


def _visual_config(ids: dict[str, int], sizes: list[int], quant_conv: bool) -> dict[str, Any]:
    """Qwen2.5-VL's vision keys + the published extras and ``vq_config``."""
    return {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "hidden_act": "silu",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": 32,
        "image_head_transformer_dims": 128,
        "image_head_transformer_layers": 1,
        "image_head_transformer_ffn_scale": 2,
        "image_start_token_id": ids["<longcat_img_start>"],
        "image_end_token_id": ids["<longcat_img_end>"],
        "image_pad_token_id": ids["<longcat_img_pad>"],
        "image_line_token_id": ids["<longcat_img_newline>"],
        "vq_config": {
            "quantizer_type": "rq",
            "depth": len(sizes),
            "codebook_size": sizes,
            "codebook_sizes": sizes,
            "codebook_dim": 32,
            "shared_codebook": False,
            "quant_conv": quant_conv,
            "in_channels": 32,
        },
    }


def _audio_config(ids: dict[str, int], sizes: list[int]) -> dict[str, Any]:
    """Whisper's encoder keys + the published extras and ``vq_config``."""
    named = (
        "audio_start audio_end audio_pad audio_delim audiotext_start audiotext_end "
        "audiotext_pad audiogen_start audiogen_end"
    ).split()
    return {
        "num_mel_bins": 128,
        "d_model": 32,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "max_source_positions": 1500,
        "activation_function": "gelu",
        "sampling_rate": 16000,
        "avg_pooler": 4,
        "audio_head_transformer_dims": 128,
        "audio_head_transformer_layers": 1,
        "audio_head_transformer_ffn_scale": 2,
        **{f"{n}_token_id": ids[f"<longcat_{n}>"] for n in named},
        "vq_config": {"codebook_sizes": sizes},
        **_audio_decoder_config(),
    }


def _audio_decoder_config() -> dict[str, Any]:
    """The decoder keys ``modular_longcat_next_audio.py`` reads (published dims unknown: the
    layer counts of the published index are 8 decoder layers, 4 post_net stages, 12 prenet
    layers, one U-Net level of 4 blocks and 12 mid blocks)."""
    return {
        "max_audio_seconds": 30,
        "hop_length": 160,
        "decoder_layers": 2,
        "decoder_attention_heads": 2,
        "decoder_ffn_dim": 64,
        "decoder_kernel_size": 4,
        "decoder_stride_size": 2,
        "vocoder_config": {
            "num_mel_bins": 80,
            "channels": [16] * 5,
            "sampling_rate": 24000,
            "hop_length": 480,
        },
        "flow_matching_config": {
            "in_channels": 80,
            "spk_emb_dim": 0,
            "diffusion_steps": 3,
            "cal_mel_mae": False,
            "prenet_in_dim": 32,
            "prenet_out_dim": 80,
            "prenet_d_model": 32,
            "prenet_attention_heads": 2,
            "prenet_ffn_dim": 64,
            "prenet_nlayers": 2,
            "prenet_activation_function": "gelu",
            "prenet_max_source_positions": 1000,
            "prenet_target_mel_length_scale_ratio": 1.0,
            "channels": [32],
            "dropout": 0.0,
            "attention_head_dim": 16,
            "n_blocks": 1,
            "num_mid_blocks": 2,
            "num_heads": 2,
            "act_fn": "gelu",
            "use_hidden_states_before_dconv2": True,
            "cfm_params": {
                "solver": "euler",
                "sigma_min": 1e-6,
                "t_scheduler": "cosine",
                "training_cfg_rate": 0.2,
                "inference_cfg_rate": 0.7,
            },
        },
        "cosy24kvocoder_config": {"weight_path": "cosy24k_vocoder/hift.pt"},
    }


def tiny_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under their published names for the parts implemented here."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vision = NextVisionTokenizer(config)
        audio = NextAudioTokenizer(config)
        audio_decoder = NextAudioDecoder(config)
        embed = torch.randn(config["vocab_size"], config["hidden_size"]) * 0.02
        parts = {
            NGRAM_PREFIX: NgramEmbedding(config),
            "visual_head.": head_for(config, "visual"),
            "audio_head.": head_for(config, "audio"),
        }
    tensors: dict[str, torch.Tensor] = {EMBED: embed}
    tensors |= _llm_tensors(config, seed)
    for prefix, module in parts.items():
        tensors.update({prefix + n: t for n, t in module.state_dict().items()})
    # Random weights would pick the end-of-audio flag (the last class of audio level 0) for
    # about one token in 65 and end the audio there; a tiny build keeps it out of reach, so
    # a request gets the audio length it asks for. A real checkpoint's head decides.
    tensors["audio_head.heads.0.bias"][-1] = -1e4
    for part in ("visual_model", "visual_bridge_model", "visual_embedding_layer"):
        for name, t in getattr(vision, part).state_dict().items():
            tensors[f"{VISION_PREFIX}{part}.{name}"] = t
    for part in ("audio_model", "audio_bridge_model"):
        for name, t in getattr(audio, part).state_dict().items():
            tensors[f"{AUDIO_PREFIX}{part}.{name}"] = t
    for part in ("audio_decoder", "audio_flow_matching_decoder"):
        for name, t in getattr(audio_decoder, part).state_dict().items():
            tensors[f"{AUDIO_PREFIX}{part}.{name}"] = t
    return tensors


def _llm_config(hidden: int) -> dict[str, Any]:
    """LongCat-Flash's decoder keys (LongcatNextConfig subclasses LongcatFlashConfig)."""
    return {
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "ffn_hidden_size": 2 * hidden,
        "expert_ffn_hidden_size": 32,
        "n_routed_experts": 6,
        "zero_expert_num": 2,
        "moe_topk": 2,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "head_dim": 8,
        "v_head_dim": 16,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _llm_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The decoder layers, final norm and lm_head under LongCat-Flash's Hugging Face names
    (one tensor per expert, as the published shards hold them)."""
    spec = TinySpec(
        architecture="LongcatFlashForCausalLM",
        vocab_size=config["text_vocab_plus_multimodal_special_token_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["ffn_hidden_size"],
        num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_attention_heads"],
        extra={
            "n_routed_experts": config["n_routed_experts"],
            "zero_expert_num": config["zero_expert_num"],
            "num_experts_per_tok": config["moe_topk"],
        },
    )
    tensors = mla_random_state_dict(spec, seed + 5)
    del tensors[EMBED]  # the whole table (codebook rows too) is the builder's
    return tensors


def _text_files(config: dict[str, Any], tokenizer: Tokenizer) -> dict[str, str]:
    base = config["text_vocab_size"]
    added = {str(base + i): {"content": t, "special": True} for t, i in SPECIAL_TOKENS.items()}
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": 64}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
    }
    return {
        "config.json": json.dumps(config, indent=2) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        "tokenizer.json": tokenizer.to_str(),
    }


# The tiny chat template ("role: text</s>"), each image / audio part between the published
# start and end tokens.
CHAT_TEMPLATE = TINY_CHAT_TEMPLATE.replace(
    "<image>", "<longcat_img_start><image><longcat_img_end>"
).replace("<audio>", "<longcat_audio_start><audio><longcat_audio_end>")


def tiny_tokenizer(config: dict[str, Any]) -> Tokenizer:
    """The tiny byte-level BPE over ``text_vocab_size`` ids, then the multimodal specials at
    their published ids (the unnamed ones as ``<longcat_reserved_i>``)."""
    base = int(config["text_vocab_size"])
    tokenizer = build_tiny_tokenizer(base)
    fill = [f"<longcat_reserved_{i}>" for i in range(tokenizer.get_vocab_size(), base)]
    names = {i: t for t, i in SPECIAL_TOKENS.items()}
    specials = [names.get(i, f"<longcat_reserved_{base + i}>") for i in range(N_SPECIAL)]
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in fill + specials])
    for token, offset in SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(token) != base + offset:
            raise RuntimeError(f"tiny tokenizer put {token} at {tokenizer.token_to_id(token)}")
    return tokenizer


def build_tiny_next(
    folder: str | Path, seed: int = 0, hidden_size: int = 64, quant_conv: bool = False
) -> Path:
    """Write the tiny published-layout checkpoint into ``folder``."""
    config = tiny_config(hidden_size, quant_conv=quant_conv)
    files = _text_files(config, tiny_tokenizer(config))
    image_decoder = {WEIGHT_PATH: tiny_image_decoder_tensors(config, seed + 11)}
    return write_checkpoint(
        folder,
        tiny_tensors(config, seed),
        files,
        shards=3,
        extra_tensor_files=image_decoder,
        torch_files={HIFT_PATH: tiny_hift_state(seed + 13)},
    )
