"""The ``options`` table of every shipped role, as msgspec Structs (ranges in ``Meta``).

Torch-free on purpose: the config loader checks a deployment's options before any process
starts, and looks them up here (``OPTIONS``, by actor string) rather than importing the
role modules, which import torch (seconds, and hundreds of MB in the supervisor).
tests/roles/test_options.py checks that ``OPTIONS`` matches each role class's ``Options``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from omniflow.runtime.actor import BadRequest
from omniflow.runtime.priority import DEFAULT_MODEL_NICE
from omniflow.runtime.tables import FieldError

S = TypeVar("S", bound=msgspec.Struct)


class ModelThreadOptions(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """What every role with a model thread takes."""

    threads: (
        Annotated[int, Meta(ge=1, description="torch intra-op threads (default: torch's)")] | None
    ) = None
    model_nice: Annotated[
        int, Meta(ge=0, le=19, description="nice levels of the model thread below the loop")
    ] = DEFAULT_MODEL_NICE


class WeightsOptions(ModelThreadOptions, kw_only=True):
    """What every role that loads weights takes."""

    model_path: Annotated[
        str, Meta(min_length=1, description="checkpoint folder (relative: to the working dir)")
    ]
    build_tiny: Annotated[
        bool, Meta(description="build tiny random weights for what model_path lacks")
    ] = False
    seed: Annotated[int, Meta(ge=0, description="seed of the build_tiny weights")] = 0
    device: Annotated[
        str, Meta(pattern=r"^(cpu|cuda(:\d+)?)$", description="where the model runs")
    ] = "cpu"

    def __post_init__(self) -> None:
        path = Path(self.model_path)
        if not self.build_tiny and not path.exists():
            raise FieldError(
                "model_path",
                f"{self.model_path} ({path.resolve()}) does not exist; "
                "set build_tiny = true to build tiny random weights there",
            )


Hidden = Annotated[int, Meta(ge=1, description="hidden size of the build_tiny model")]


class _EncoderOptions(WeightsOptions, kw_only=True):
    hidden_size: Hidden = 64
    max_bytes: Annotated[int, Meta(ge=1, description="largest encoded input accepted")] = 64 << 20
    cache_entries: Annotated[int, Meta(ge=0, description="encoder-output cache entries")] = 256
    cache_mb: Annotated[int, Meta(ge=0, description="encoder-output cache MiB")] = 256

    def spills_to_ssd(self) -> bool:
        """Whether the role keeps an SSD tier in [cache] ssd_dir (when set): its cache's."""
        return self.cache_entries > 0


class VisionEncoderOptions(_EncoderOptions, kw_only=True):
    max_pixels: Annotated[
        int, Meta(ge=1, description="images are resized to at most this many pixels")
    ] = 448 * 448
    max_image_pixels: Annotated[
        int, Meta(ge=1, description="larger images are refused before decoding")
    ] = 64_000_000


ACCEPTED_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)


class AudioEncoderOptions(_EncoderOptions, kw_only=True):
    sample_rates: Annotated[
        list[Annotated[int, Meta(ge=1)]],
        Meta(min_length=1, description="WAV sample rates accepted"),
    ] = msgspec.field(default_factory=lambda: list(ACCEPTED_RATES))
    max_seconds: Annotated[float, Meta(gt=0, description="longest clip accepted")] = 120.0


class LLMOptions(WeightsOptions, kw_only=True):
    threads: Annotated[int, Meta(ge=1, description="torch intra-op threads")] | None = 1
    hidden_size: Hidden = 64
    tiny_preset: Annotated[
        Literal[
            "llama-mha",
            "deepseek-v2-tiny",
            "deepseek-v2-lite-tiny",
            "longcat-flash-tiny",
            "longcat-next-tiny",
        ],
        Meta(
            description="architecture of the build_tiny LLM (longcat-next-tiny: the one "
            "published-layout LongCat-Next folder the encoders read too)"
        ),
    ] = "llama-mha"
    kv_cache_mb: Annotated[int, Meta(ge=1, description="device KV cache MiB")] = 64
    max_model_len: (
        Annotated[
            int, Meta(ge=1, description="longest prompt + output (default: the model's context)")
        ]
        | None
    ) = None
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Meta(description="weights and KV dtype (auto: float32 on CPU, the checkpoint's on GPU)"),
    ] = "auto"
    max_num_seqs: Annotated[int, Meta(ge=1, description="requests batched at once")] = 128
    host_kv_mb: Annotated[int, Meta(ge=0, description="evicted KV pages kept in the host pool")] = 0
    ssd_kv_mb: Annotated[int, Meta(ge=0, description="and below that in [cache] ssd_dir")] = 0
    share_kv: Annotated[
        bool, Meta(description="K/V in the host pool, lendable to other processes")
    ] = False
    max_tokens: Annotated[int, Meta(ge=1, description="cap on a request's max_tokens")] = 64
    chat_template: Annotated[
        str,
        Meta(description="a Jinja chat template or a path to one (default: the checkpoint's)"),
    ] = ""
    max_sessions: Annotated[int, Meta(ge=1, description="dialogue sessions kept")] = 1024
    summary_media: Annotated[
        int, Meta(ge=0, description="leading media published for prefix_aware routing")
    ] = 256
    backend: Annotated[
        Literal["torch", "sglang"],
        Meta(description="engine backend; sglang: SGLang's forward, text outputs only"),
    ] = "torch"
    kv_pull: Annotated[
        bool,
        Meta(description="pull a prompt's prefix KV from the replica holding it when cheaper"),
    ] = True

    def spills_to_ssd(self) -> bool:
        """Whether the role keeps an SSD tier in [cache] ssd_dir (when set): its KV pages
        below the host tier (none without a host tier)."""
        return self.ssd_kv_mb > 0 and self.host_kv_mb > 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ssd_kv_mb and not self.host_kv_mb:  # pages reach the SSD from the host tier
            raise FieldError("ssd_kv_mb", "needs host_kv_mb > 0 (pages spill from the host tier)")
        if self.backend == "sglang":
            # Imports torch, so only for a deployment that asks for SGLang.
            from omniflow.engine.sglang_backend import sglang_missing

            missing = sglang_missing()
            if missing:
                raise FieldError("backend", f"'sglang' needs {missing}")


class ImageDecoderOptions(WeightsOptions, kw_only=True):
    steps: Annotated[int, Meta(ge=1, description="Euler steps of the refiner")] = 4
    cfg_scale: Annotated[
        float,
        Meta(ge=0, le=30, description="the refiner's text guidance (a request's cfg_scale wins)"),
    ] = 2.0
    max_tokens: Annotated[int, Meta(ge=1, description="largest image grid h*w accepted")] = 1024


class AudioDecoderOptions(WeightsOptions, kw_only=True):
    # One thread: a chunk of a few tokens is latency-bound, and the decoder runs while the
    # llm makes the next codes; two torch pools on the same cores slowed the first chunk
    # several times over (benchmarks/omni_chat.py --decoder-threads).
    threads: Annotated[int, Meta(ge=1, description="torch intra-op threads")] | None = 1
    max_chunk_tokens: Annotated[
        int, Meta(ge=1, description="largest chunk of audio tokens accepted")
    ] = 512
    noise_seed: Annotated[
        int, Meta(ge=0, description="seeds the flow decoder's start noise, with the chunk index")
    ] = 0
    crossfade_ms: Annotated[
        float,
        Meta(ge=0, le=500, description="cross-fade between a stream's chunks (0: none)"),
    ] = 50.0
    conv: Annotated[
        Literal["auto", "mkldnn", "native"],
        Meta(
            description="convolution path: auto times a one-token chunk both ways at setup "
            "and keeps the faster (replicas may then differ in a sample's last bit)"
        ),
    ] = "auto"


class BackboneOptions(WeightsOptions, kw_only=True):
    share_weights: Annotated[
        bool,
        Meta(
            description="map the backbone from the host pool, one copy with the other role "
            "(false: load a private copy, laid out for this process)"
        ),
    ] = True


class HunyuanAROptions(BackboneOptions, kw_only=True):
    threads: Annotated[int, Meta(ge=1, description="torch intra-op threads")] | None = 1
    kv_cache_mb: Annotated[
        int, Meta(ge=1, description="KV MiB in the host pool (lent to diffusion)")
    ] = 32
    max_prompt_tokens: Annotated[int, Meta(ge=1, description="longest prompt accepted")] = 1024
    recaption_tokens: Annotated[
        int, Meta(ge=0, description="tokens of the AR recaption stage (0: none)")
    ] = 0
    sequence_template: Annotated[
        Literal["pretrain", "instruct"] | None,
        Meta(
            description="the prompt's layout (unset: generation_config.json's "
            "sequence_template, else 'pretrain')"
        ),
    ] = None
    system_prompt: (
        Annotated[
            str,
            Meta(
                min_length=1,
                description="a system prompt ahead of every prompt (unset: none, as "
                "generation_config.json's use_system_prompt 'None')",
            ),
        ]
        | None
    ) = None
    max_image_bytes: Annotated[int, Meta(ge=1, description="largest condition image")] = 32 << 20
    max_image_pixels: Annotated[
        int, Meta(ge=1, description="larger condition images are refused before decoding")
    ] = 64_000_000
    max_image_tokens: Annotated[
        int, Meta(ge=1, description="largest image (latent tokens) accepted")
    ] = 1024
    lend_to: Annotated[
        str, Meta(min_length=1, description="the role the context KV is lent to")
    ] = "diffusion"
    lend_kv: Annotated[
        bool,
        Meta(
            description="lend the context KV to lend_to (false: send the context's ids and "
            "rows; diffusion, with reuse_prefix = false, computes it)"
        ),
    ] = True
    lease_claim_s: Annotated[
        float,
        Meta(
            gt=0,
            description="seconds: a lent KV that diffusion has not claimed by then (lost, or "
            "still queued there) is revoked and that request fails",
        ),
    ] = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lend_kv and self.device != "cpu":
            # The lease book lends host-pool KV pages only; device KV cannot be lent yet.
            raise FieldError(
                "lend_kv",
                f'lend_kv = true with device = "{self.device}": lent KV lives in the host '
                "pool, so only a CPU ar can lend it; set lend_kv = false (and the diffusion "
                'role\'s reuse_prefix = false) or device = "cpu"',
            )


class HunyuanDiffusionOptions(BackboneOptions, kw_only=True):
    threads: Annotated[int, Meta(ge=1, description="torch intra-op threads")] | None = 1
    steps: (
        Annotated[
            int,
            Meta(
                ge=1,
                le=1000,
                description="denoising steps (a request's steps wins; unset: the folder's "
                "generation_config.json diff_infer_steps)",
            ),
        ]
        | None
    ) = None
    max_steps: Annotated[int, Meta(ge=1, description="most steps a request may ask")] = 200
    cfg_scale: (
        Annotated[
            float,
            Meta(
                ge=0,
                le=30,
                description="guidance scale (a request's cfg_scale wins; unset: "
                "generation_config.json diff_guidance_scale)",
            ),
        ]
        | None
    ) = None
    shift: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="flow-matching sigma shift (unset: generation_config.json flow_shift)",
            ),
        ]
        | None
    ) = None
    kv_cache_mb: Annotated[int, Meta(ge=1, description="KV MiB for the image rows")] = 32
    reuse_prefix: Annotated[
        bool,
        Meta(
            description="borrow ar's context KV (false: compute it here from the ids, as a "
            "separate stage does; for ar on another host, with ar's lend_kv = false)"
        ),
    ] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reuse_prefix and self.device != "cpu":
            raise FieldError(
                "reuse_prefix",
                f'reuse_prefix = true with device = "{self.device}": the borrowed KV lives in '
                "the host pool, so only a CPU diffusion role can read it; set reuse_prefix = "
                'false (and ar\'s lend_kv = false) or device = "cpu"',
            )


class VAEDecoderOptions(WeightsOptions, kw_only=True):
    threads: Annotated[int, Meta(ge=1, description="torch intra-op threads")] | None = 1
    max_image_tokens: Annotated[int, Meta(ge=1, description="largest latent (tokens) accepted")] = (
        1024
    )


class EchoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    fail_on: Annotated[str, Meta(description="raise for this text (tests)")] = ""
    crash_on: Annotated[str, Meta(description="exit the process for this text (tests)")] = ""
    delay_ms: Annotated[float, Meta(ge=0, description="sleep this long per request")] = 0.0


OPTIONS: dict[str, type[msgspec.Struct]] = {
    "omniflow.roles.vision_encoder:VisionEncoderRole": VisionEncoderOptions,
    "omniflow.roles.audio_encoder:AudioEncoderRole": AudioEncoderOptions,
    "omniflow.roles.llm:LLMRole": LLMOptions,
    "omniflow.roles.image_decoder:ImageDecoderRole": ImageDecoderOptions,
    "omniflow.roles.audio_decoder:AudioDecoderRole": AudioDecoderOptions,
    "omniflow.roles.hunyuan_ar:ARRole": HunyuanAROptions,
    "omniflow.roles.hunyuan_diffusion:DiffusionRole": HunyuanDiffusionOptions,
    "omniflow.roles.vae_decoder:VAEDecoderRole": VAEDecoderOptions,
    "omniflow.roles.echo:Upper": EchoOptions,
    "omniflow.roles.echo:Reverse": EchoOptions,
}


# ---------------------------------------------------------------- request parameters
#
# A request's ``params`` travel unchanged along its whole path; each role reads the keys it
# declares here (types and ranges in ``Meta``) and ignores the rest. The CLI checks a
# request's keys and types against the union over the deployment's roles before sending
# (``omniflow.runtime.loading.params_type``), so a typo (``max_token``) is refused, not
# silently ignored; each role checks its ranges (``read_params``) when the request arrives.


class LLMParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    want: Annotated[
        str | list[str], Meta(description="output modalities: some of text,image,audio")
    ] = "text"
    max_tokens: Annotated[
        int, Meta(ge=1, description="text tokens to generate, up to the role's max_tokens option")
    ] = 16
    temperature: Annotated[float, Meta(ge=0, description="0: greedy")] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1, description="nucleus sampling mass")] = 1.0
    top_k: Annotated[int, Meta(description="keep the k likeliest tokens (<= 0: all)")] = 0
    min_p: Annotated[float, Meta(ge=0, le=1, description="drop tokens below min_p * top")] = 0.0
    seed: Annotated[int, Meta(description="makes the request's samples reproducible")] = 0
    repetition_penalty: Annotated[float, Meta(gt=0, description="1: off")] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2, le=2, description="0: off")] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2, description="0: off")] = 0.0
    stop: Annotated[str | list[str], Meta(description="stop strings (cut from the text)")] = ""
    logprobs: Annotated[
        int, Meta(ge=0, le=20, description="report each token's logprob and this many others")
    ] = 0
    image_grid: Annotated[
        list[Annotated[int, Meta(ge=1, le=32)]],
        Meta(min_length=2, max_length=2, description="[h, w] image tokens, 1..32 each"),
    ] = msgspec.field(default_factory=lambda: [4, 4])
    cfg_scale: Annotated[float, Meta(ge=0, le=30, description="image guidance scale")] = 2.0
    audio_chunks: Annotated[int, Meta(ge=1, le=64, description="audio chunks, at most")] = 3
    audio_chunk_tokens: Annotated[int, Meta(ge=1, le=256, description="audio tokens per chunk")] = 4
    audio_first_chunk_tokens: Annotated[
        int,
        Meta(
            ge=0,
            le=256,
            description="audio tokens in the first chunk, sent sooner (0: audio_chunk_tokens)",
        ),
    ] = 1
    audio_text: Annotated[
        Literal["", "parallel", "serial"],
        Meta(
            description="text with audio: made beside it in one decode (parallel; the "
            "default where the model has audiotext tokens) or all before it (serial)"
        ),
    ] = ""


class ImageDecoderParams(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    cfg_scale: Annotated[
        float, Meta(ge=0, le=30, description="guidance scale (default: the option)")
    ] = 2.0
    seed: Annotated[int, Meta(description="noise seed")] = 0
    steps: Annotated[int, Meta(ge=1, le=200, description="Euler steps (default: the option)")] = 4


class TextToImageParams(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """HunyuanImage-3's `ar` and `diffusion` (ranges checked by roles/image_params.py)."""

    want: Annotated[str | list[str], Meta(description="image (the only output made)")] = "image"
    seed: Annotated[int, Meta(ge=0, description="noise seed: same seed, same PNG bytes")] = 0
    steps: Annotated[
        int, Meta(ge=1, description="denoising steps, up to diffusion's max_steps option")
    ] = 8
    cfg_scale: Annotated[float, Meta(ge=0, le=30, description="guidance scale")] = 2.5
    size: Annotated[
        str | list[int],
        Meta(description='"WxH" in pixels (multiples of 16) or "auto" (the AR step picks)'),
    ] = "auto"


class EchoParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    delay_ms: Annotated[float, Meta(ge=0, description="sleep this long in each role")] = 0.0


class NoParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A role that reads no request parameter."""


PARAMS: dict[str, type[msgspec.Struct]] = {
    "omniflow.roles.vision_encoder:VisionEncoderRole": NoParams,
    "omniflow.roles.audio_encoder:AudioEncoderRole": NoParams,
    "omniflow.roles.llm:LLMRole": LLMParams,
    "omniflow.roles.image_decoder:ImageDecoderRole": ImageDecoderParams,
    "omniflow.roles.audio_decoder:AudioDecoderRole": NoParams,
    "omniflow.roles.echo:Upper": EchoParams,
    "omniflow.roles.echo:Reverse": EchoParams,
    "omniflow.roles.gateway:Gateway": NoParams,
    "omniflow.roles.hunyuan_ar:ARRole": TextToImageParams,
    "omniflow.roles.hunyuan_diffusion:DiffusionRole": TextToImageParams,
    "omniflow.roles.vae_decoder:VAEDecoderRole": NoParams,
}


# The outputs each shipped role makes (the gateway offers those modalities).
MAKES: dict[str, tuple[str, ...]] = {
    "omniflow.roles.llm:LLMRole": ("text",),
    "omniflow.roles.image_decoder:ImageDecoderRole": ("image",),
    "omniflow.roles.audio_decoder:AudioDecoderRole": ("audio",),
    "omniflow.roles.vae_decoder:VAEDecoderRole": ("image",),
}


def read_params(schema: type[S], params: Mapping[str, Any]) -> S:
    """The keys of ``params`` that ``schema`` declares, checked (type and range).

    Raises BadRequest naming ``params.KEY`` and what it expected.
    """
    names = schema.__struct_fields__
    mine = {k: v for k, v in params.items() if k in names}
    try:
        return msgspec.convert(mine, schema)
    except msgspec.ValidationError as e:
        field, message = _split_path(str(e))
        raise BadRequest(f"params.{field}" if field else "params", message) from None


def _split_path(error: str) -> tuple[str, str]:
    """msgspec's "Expected `float`, got `str` - at `$.cfg_scale`" as ("cfg_scale", "...")."""
    message, sep, path = error.rpartition(" - at `$.")
    if not sep:
        return "", error
    return path.rstrip("`"), message
