"""Engine sizing: the memory budget becomes slots and pages; max_model_len must fit both the checkpoint and the pool."""

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
