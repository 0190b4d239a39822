"""LLM engines: the protocol, the torch backend, the offline and asyncio-facing APIs."""

from omniflow.engine.async_engine import AsyncEngine, EngineDeadError
from omniflow.engine.heads import BlockRows, CodesHead, Guidance
from omniflow.engine.llm import LLM, GenerationOutput
from omniflow.engine.llm_engine import EngineConfig, LLMEngine
from omniflow.engine.protocol import EngineBackend, TokenDelta
from omniflow.engine.sampling_params import SamplingParams
from omniflow.engine.sequence import EmbeddingSpan
from omniflow.engine.spoken import Spoken
from omniflow.kv.allocator import OutOfPages, PageAllocator, PageUsage, PrefixMatch

__all__ = [
    "LLM",
    "AsyncEngine",
    "BlockRows",
    "CodesHead",
    "EngineDeadError",
    "EmbeddingSpan",
    "EngineBackend",
    "EngineConfig",
    "GenerationOutput",
    "Guidance",
    "LLMEngine",
    "OutOfPages",
    "PageAllocator",
    "PageUsage",
    "PrefixMatch",
    "SamplingParams",
    "Spoken",
    "TokenDelta",
]
