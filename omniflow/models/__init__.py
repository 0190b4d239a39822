"""Model definitions, Hugging Face-layout loaders and tiny random-weight builders."""

from omniflow.models.deepseek.config import MLA_ARCHITECTURES, MLAConfig
from omniflow.models.deepseek.decoder import MLADecoderLM
from omniflow.models.hunyuan_image3.config import HunyuanImage3Config
from omniflow.models.hunyuan_image3.model import HunyuanImage3LM
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts, load_image_parts
from omniflow.models.llama.config import DecoderConfig
from omniflow.models.llama.decoder import AttentionFn, DecoderLM
from omniflow.models.loader import checkpoint_files, load_config, load_decoder, load_tokenizer
from omniflow.models.text_tokenizer import TextTokenizer
from omniflow.models.tiny.builder import PRESETS, TinySpec, build_tiny_model
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3

__all__ = [
    "MLA_ARCHITECTURES",
    "PRESETS",
    "AttentionFn",
    "DecoderConfig",
    "DecoderLM",
    "HunyuanImage3Config",
    "HunyuanImage3LM",
    "HunyuanImage3Parts",
    "MLAConfig",
    "MLADecoderLM",
    "TextTokenizer",
    "TinySpec",
    "build_tiny_hunyuan_image3",
    "build_tiny_model",
    "checkpoint_files",
    "load_config",
    "load_decoder",
    "load_image_parts",
    "load_tokenizer",
]
