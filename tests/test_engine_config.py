"""Engine sizing: the memory budget becomes slots and pages; max_model_len must fit both the checkpoint and the pool;
the engine process's malloc keeps freed memory."""

import subprocess
import sys

import pytest

from deltaserve import LLM
from deltaserve.engine.config import parse_bytes
from deltaserve.errors import ConfigError


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes(1000) == 1000
    assert parse_bytes("2e6") == 2_000_000
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        parse_bytes("lots")


def test_pool_sizing_and_max_model_len(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    llm = LLM(path, kv_cache_memory="1MiB", block_size=16, max_num_seqs=4)
    e = llm.engine
    slot = e.states.bytes_per_slot(e.config)
    page = e.pages.bytes_per_token(e.config, e.model.embed_tokens.weight.dtype) * 16
    assert e.states.num_slots == 4
    ckpt = min(4 * 4, int(0.2 * (1 << 20)) // slot)  # default checkpoints: 20% of the budget, at most 4 per seq
    assert e.core.checkpoints.num_slots == ckpt
    assert e.pages.num_blocks == ((1 << 20) - (4 + ckpt) * slot) // page
    off = LLM(path, kv_cache_memory="1MiB", block_size=16, max_num_seqs=4, enable_prefix_caching=False).engine
    assert off.core.checkpoints is None and off.core.prefix is None
    assert off.pages.num_blocks == ((1 << 20) - 4 * slot) // page
    assert e.max_model_len == min(e.config.max_position_embeddings, e.pages.num_blocks * 16)
    with pytest.raises(ConfigError, match="max_model_len 4096 does not fit the page pool"):
        LLM(path, kv_cache_memory="1MiB", block_size=16, max_model_len=4096)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(path, max_model_len=10 ** 7)
    with pytest.raises(ConfigError, match="too small"):
        LLM(path, kv_cache_memory=1000)


def test_the_engine_process_keeps_freed_memory():
    """After keep_freed_memory (the engine calls it at start) a step's activations freed together (48 of 1 MiB) are
    reused by the next step, not returned to the OS and faulted in again, as they are once glibc trims at 128 KiB
    (its default threshold; where it starts depends on the heap's history, so the test sets it): ~12,000 faults a
    round. In fresh interpreters, so no other test's threads fault meanwhile."""
    script = """
import ctypes, resource, sys, torch
from deltaserve.engine.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:
    assert ctypes.CDLL(None).mallopt(-1, 128 << 10) == 1  # M_TRIM_THRESHOLD
for _ in range(2):
    step = [torch.empty(1 << 18).fill_(1.0) for _ in range(48)]
    del step
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step = [torch.empty(1 << 18).fill_(1.0) for _ in range(48)]
    del step
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    faults = {mode: int(subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("keep", "trim")}
    assert faults["keep"] < 1000 and faults["trim"] > 4 * 10_000


def test_backend_choice_and_reasons(monkeypatch):
    """--backend auto takes native where `native_choice` says the kernels suit the CPU, else torch; --ops reference
    runs on torch; explicit choices are kept; native with the reference ops, or without a built library, is refused
    with the reason. Every choice carries a reason (logged, and returned by /version)."""
    from deltaserve.backends.select import select_backend
    from deltaserve.engine.config import EngineArgs
    from deltaserve.ops import native

    usable, why = native.native_choice()
    auto = select_backend("auto", "fast")
    assert auto.name == ("native" if usable else "torch") and why in auto.reason and auto.reason.startswith("auto")
    assert auto.ops.name == ("native" if usable else "fast")
    torch_backend = select_backend("torch", "fast")
    assert (torch_backend.name, torch_backend.ops.name) == ("torch", "fast")
    reference = select_backend("auto", "reference")
    assert (reference.name, reference.ops.name) == ("torch", "reference") and "reference" in reference.reason
    assert select_backend("native", "fast").describe() == {"backend": "native", "ops": "native",
                                                          "reason": f"--backend native; {why}"}
    with pytest.raises(ConfigError, match="reference"):
        EngineArgs(backend="native", ops="reference")
    with pytest.raises(ConfigError, match="backend must be one of"):
        EngineArgs(backend="cuda")
    from deltaserve.backends import select
    monkeypatch.setattr(select, "native_choice", lambda: (False, "aarch64: not measured"))
    fallback = select_backend("auto", "fast")
    assert fallback.name == "torch" and fallback.reason == "auto: aarch64: not measured"
    monkeypatch.setattr(select, "native_library", lambda: None)
    monkeypatch.setattr(select, "native_choice", lambda: (False, "the native kernels did not build"))
    with pytest.raises(ConfigError, match="--backend native: the native kernels did not build"):
        select_backend("native", "fast")
