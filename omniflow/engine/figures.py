"""An LLM engine's figures for /metrics: KV pages per tier, the scheduler's queues, counters.

Read on the role's event loop while the engine thread steps: each figure is one read of
an int or a list's length (atomic under the GIL), so a figure may be a step old, never torn.
"""

from __future__ import annotations

from typing import Any


def engine_figures(engine: Any) -> dict[str, float]:
    """``engine``: an ``LLMEngine`` (its allocator, scheduler and KV tiers)."""
    scheduler = engine.scheduler
    usage = engine.allocator.usage()
    figures = {
        "kv_pages_used:device": float(usage.total_pages - usage.free_pages),
        "kv_pages_free:device": float(usage.free_pages),
        "kv_pages_cached:device": float(usage.cached_pages),
        "running": float(len(scheduler.running)),
        "waiting": float(len(scheduler.waiting) + len(scheduler.promoting)),
        "preemptions_total": float(scheduler.num_preemptions),
        "prefix_hit_tokens_total": float(scheduler.prefix_hit_tokens),
        "prompt_tokens_computed_total": float(engine.stats["prompt_tokens_computed"]),
        "step_seconds_sum": engine.step_seconds,
        "step_seconds_count": float(engine.stats["steps"]),
    }
    tiers = engine.tiers
    if tiers is not None:
        figures["kv_pages_used:host"] = float(tiers.host_used)
        figures["kv_pages_free:host"] = float(tiers.host_free)
        if tiers.ssd is not None:
            free = tiers.ssd_free
            figures["kv_pages_used:ssd"] = float(tiers.ssd.slots - free)
            figures["kv_pages_free:ssd"] = float(free)
    return figures


def engine_description(engine: Any) -> dict[str, Any]:
    """What an ``LLMEngine`` loaded, for its replica's start-up log line."""
    import torch

    cache, config = engine.cache, engine.config
    weights = next(iter(engine.model.parameters()), None) if engine.model is not None else None
    kernels = getattr(engine.runner, "kernels", None)
    device = str(cache.keys.device)
    return {
        "dtype": str(weights.dtype if weights is not None else cache.keys.dtype).removeprefix(
            "torch."
        ),
        "device": device,
        "kv_pages": cache.num_pages,
        "page_size": cache.page_size,
        "kv_mib": round((cache.keys.nbytes + cache.values.nbytes) / 2**20, 1),
        "kv_tokens": cache.num_pages * cache.page_size,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "threads": torch.get_num_threads(),
        # The compute path: omniflow's CPU kernels, SGLang's, or PyTorch's own ops.
        "kernels": "sglang"
        if engine.model is None
        else "omniflow-cpu"
        if kernels is not None
        else f"torch-{device.split(':')[0]}",
    }
