"""LongCat-Next parts: the published-layout tokenizers, image decoder and audio decoder
(next_*.py, checkpoint.py) and our stand-in depth head and code embedder ({"kind": ...}
folders)."""

from omniflow.models.omni.depth_head import DepthHead, DepthHeadConfig
from omniflow.models.omni.embedder import CodeEmbedder
from omniflow.models.omni.loader import (
    KINDS,
    ModelFormatError,
    build_tiny,
    build_tiny_depth_head,
    ensure_model,
    has_model,
    load_depth_head,
    load_model,
    save_model,
)
from omniflow.models.omni.mel import LogMel, mel_filterbank
from omniflow.models.omni.next_hift import to_pcm16
from omniflow.models.omni.rvq import ResidualVQ, check_ids

__all__ = [
    "KINDS",
    "CodeEmbedder",
    "DepthHead",
    "DepthHeadConfig",
    "LogMel",
    "ModelFormatError",
    "ResidualVQ",
    "build_tiny",
    "build_tiny_depth_head",
    "check_ids",
    "ensure_model",
    "has_model",
    "load_depth_head",
    "load_model",
    "mel_filterbank",
    "save_model",
    "to_pcm16",
]
