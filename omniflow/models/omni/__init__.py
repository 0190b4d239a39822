"""Tiny LongCat-style omni models: tokenizers, depth head, image and audio decoders, loaders."""

from omniflow.models.omni.audio import AudioConfig, AudioTokenizer
from omniflow.models.omni.audio_decoder import AudioDecoder, AudioDecoderConfig, to_pcm16
from omniflow.models.omni.depth_head import DepthHead, DepthHeadConfig
from omniflow.models.omni.embedder import CodeEmbedder
from omniflow.models.omni.image_decoder import FlowRefiner, ImageDecoder, ImageDecoderConfig
from omniflow.models.omni.loader import (
    KINDS,
    ModelFormatError,
    build_tiny,
    build_tiny_audio,
    build_tiny_audio_decoder,
    build_tiny_depth_head,
    build_tiny_image_decoder,
    build_tiny_vision,
    ensure_model,
    has_model,
    load_audio,
    load_audio_decoder,
    load_depth_head,
    load_image_decoder,
    load_model,
    load_vision,
    save_model,
)
from omniflow.models.omni.mel import LogMel, mel_filterbank
from omniflow.models.omni.rvq import ResidualVQ, check_ids
from omniflow.models.omni.vision import VisionCodes, VisionConfig, VisionTokenizer
from omniflow.models.omni.vocoder import Vocoder

__all__ = [
    "KINDS",
    "AudioConfig",
    "AudioDecoder",
    "AudioDecoderConfig",
    "AudioTokenizer",
    "CodeEmbedder",
    "DepthHead",
    "DepthHeadConfig",
    "FlowRefiner",
    "ImageDecoder",
    "ImageDecoderConfig",
    "LogMel",
    "ModelFormatError",
    "ResidualVQ",
    "VisionCodes",
    "VisionConfig",
    "VisionTokenizer",
    "Vocoder",
    "build_tiny",
    "build_tiny_audio",
    "build_tiny_audio_decoder",
    "build_tiny_depth_head",
    "build_tiny_image_decoder",
    "build_tiny_vision",
    "check_ids",
    "ensure_model",
    "has_model",
    "load_audio",
    "load_audio_decoder",
    "load_depth_head",
    "load_image_decoder",
    "load_model",
    "load_vision",
    "mel_filterbank",
    "save_model",
    "to_pcm16",
]
