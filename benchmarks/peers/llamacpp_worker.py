"""llama.cpp side of `llamacpp_vs_deltaserve.py`: runs in the Python that has llama-cpp-python (no torch needed).

Reads one JSON request per line on stdin, answers one JSON line on stdout:
  {"op": "init", "gguf": PATH, "threads": 2, "n_seq_max": 32, "n_ctx": 8192, "n_batch": 4096}
      -> {"ok", "version", "n_vocab", "model_bytes" (all tensors), "desc" (llama.cpp's "arch size type" line)}
  {"op": "generate", "prompts": [[ids...], ...], "output_len": O}
      -> {"ttft_s", "total_s", "tokens": [[ids...], ...]}   greedy (argmax of the logits), no eos stop
  {"op": "prefill", "prompt": [ids...]} -> {"prefill_s"}   one sequence, llama_decode of the whole prompt
  {"op": "quit"}

Sequences run through the low-level API as one llama_batch with a seq_id per sequence (prefill: every prompt token
of every sequence in one llama_decode, logits on each sequence's last token; decode: one token per sequence per
llama_decode), so batch B is B concurrent streams in one context, as llama.cpp's server and batched example run
them. The memory (KV cells and recurrent KDA states) is cleared before every request.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp as L
import numpy as np


class Runner:
    def __init__(self, gguf: str, threads: int, n_seq_max: int, n_ctx: int, n_batch: int):
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_seq_max = n_ctx, n_batch, n_seq_max
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True  # any sequence may use any KV cell (sequences of unequal need share one pool)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_batch, 0, n_seq_max)
        self.n_batch = n_batch

    def _clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, pos, seq, wants_logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = L.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def generate(self, prompts: list[list[int]], output_len: int) -> dict:
        self._clear()
        start = time.perf_counter()
        items, last = [], []
        for s, p in enumerate(prompts):
            items += [(t, j, s, j == len(p) - 1) for j, t in enumerate(p)]
            last.append(len(items) - 1)
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} prompt tokens > n_batch {self.n_batch}")
        self._decode(items)
        out = [[self._argmax(i)] for i in last]
        ttft = time.perf_counter() - start
        pos = [len(p) for p in prompts]
        for _ in range(output_len - 1):
            self._decode([(out[s][-1], pos[s], s, True) for s in range(len(prompts))])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
                pos[s] += 1
        return {"ttft_s": ttft, "total_s": time.perf_counter() - start, "tokens": out}

    def prefill(self, prompt: list[int]) -> dict:
        self._clear()
        start = time.perf_counter()
        self._decode([(t, j, 0, j == len(prompt) - 1) for j, t in enumerate(prompt)])
        self._argmax(len(prompt) - 1)
        return {"prefill_s": time.perf_counter() - start}


def main() -> int:
    runner = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "init":
                runner = Runner(req["gguf"], req["threads"], req["n_seq_max"], req["n_ctx"], req["n_batch"])
                desc = ctypes.create_string_buffer(128)
                L.llama_model_desc(runner.model, desc, len(desc))
                ans = {"ok": True, "version": L.__version__, "n_vocab": runner.n_vocab,
                       "model_bytes": L.llama_model_size(runner.model), "desc": desc.value.decode()}
            elif req["op"] == "generate":
                ans = runner.generate(req["prompts"], req["output_len"])
            elif req["op"] == "prefill":
                ans = runner.prefill(req["prompt"])
            else:
                break
        except Exception as e:  # report to the driver instead of dying silently
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
