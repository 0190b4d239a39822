"""Offline batch generation in the style of vLLM/SGLang:

llm = LLM(model_path)
outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from omniflow.engine.llm_engine import EngineConfig, LLMEngine
from omniflow.engine.sampling_params import SamplingParams

Prompt = str | SequenceOf[int]


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    cached_tokens: int
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None


class LLM:
    def __init__(self, model_path: str | Path, device: str = "auto", **engine_options: Any):
        self.engine = LLMEngine(model_path, EngineConfig(device=device, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        # One prompt (text or token ids) or a list of them; a list's first item tells which.
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [cast(Prompt, prompts)]
        else:
            prompt_list = cast(list[Prompt], prompts)
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompt_list)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} SamplingParams")
        request_ids = []
        for prompt, request_params in zip(prompt_list, params_list, strict=True):
            request_id = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, self._token_ids(prompt, request_id), request_params)
            request_ids.append(request_id)
        finished = {}
        prompt_ids = {rid: self.engine.sequences[rid].prompt_token_ids for rid in request_ids}
        outputs: dict[str, list] = {rid: [[], [], []] for rid in request_ids}
        for delta in self.engine.run_to_completion():
            token_ids, logprobs, tops = outputs[delta.request_id]
            token_ids += delta.token_ids
            logprobs += delta.logprobs
            if delta.top_logprobs is not None:
                tops += delta.top_logprobs
            if delta.finish_reason is not None:
                finished[delta.request_id] = delta
        results = []
        for request_id, request_params in zip(request_ids, params_list, strict=True):
            token_ids, logprobs, tops = outputs[request_id]
            final = finished[request_id]
            if final.finish_reason is None:
                raise RuntimeError(f"request {request_id}: finished without a finish_reason")
            results.append(
                GenerationOutput(
                    request_id,
                    prompt_ids[request_id],
                    token_ids,
                    self._text(token_ids, final.stop_reason),
                    final.num_cached_tokens,
                    final.finish_reason,
                    final.stop_reason,
                    logprobs,
                    tops if (request_params or SamplingParams()).logprobs is not None else None,
                )
            )
        return results

    def _token_ids(self, prompt: Prompt, request_id: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id}: a text prompt needs tokenizer.json")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _text(self, token_ids: list[int], stop_reason: int | str | None) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids)
        if isinstance(stop_reason, str):
            text = text[: text.index(stop_reason)] if stop_reason in text else text
        return text
