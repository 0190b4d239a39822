"""SGLang as the forward pass behind omniflow's scheduler, pages and sampler.

The mapping (see protocol.py for the full text): omniflow keeps the Scheduler, the
PageAllocator and the Sampler; each step becomes one SGLang `ForwardBatch` whose
`out_cache_loc` is our slot mapping and whose `req_to_token` rows come from our page
tables, over K/V buffers that are views of omniflow's KVCache; SGLang's
`model.forward(input_ids, positions, forward_batch)` returns the logits we sample.

sglang needs a CUDA build and cannot be installed in every environment; this module
imports it lazily and says exactly what is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omniflow.engine.llm_engine import EngineConfig

REQUIRED_MODULES = (
    "sglang",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.mem_cache.memory_pool",
)


def missing_sglang_modules() -> list[str]:
    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


class SGLangBackend:
    """EngineBackend whose model forward is SGLang's (GPU only)."""

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None):
        missing = missing_sglang_modules()
        if missing:
            raise ImportError(
                f"the sglang backend needs the sglang package (missing: {', '.join(missing)}); "
                "install it on a CUDA machine with `pip install 'omniflow[sglang]'`, "
                "or use the default torch backend (omniflow.engine.LLMEngine)"
            )
        raise NotImplementedError(
            "SGLangBackend: the ForwardBatch adapter (omniflow page tables -> SGLang "
            "req_to_token/out_cache_loc over shared K/V buffers) is not written yet; "
            "use omniflow.engine.LLMEngine"
        )
