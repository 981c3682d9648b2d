"""What travels between a prefill and a decode instance (deltaserve/disagg): one request's pages and KDA state copied
out of one engine's pools and into another's bit for bit, their size equal to the accounting the pools are sized by,
the handshake refusing a different cache format, and the wire format refusing malformed messages."""

from __future__ import annotations

import msgpack
import pytest
import torch

from deltaserve.disagg import cache_format, check_format, decode_message, encode_message, export_kv, import_kv
from deltaserve.disagg.payload import STATE_CONV, STATE_RECURRENT, transfer_bytes
from deltaserve.errors import KVTransferError
from engine_utils import greedy, make_llm, random_prompts


def _running_request(llm, prompt):
    """Add a prompt and step until it is computed; the request, still running (its second token is to come)."""
    core = llm.engine.core
    core.add_request("r", prompt, greedy(2))
    while core.scheduler.running == [] or core.scheduler.running[0].num_computed_tokens < len(prompt):
        core.step()
    return core.scheduler.running[0]


@pytest.mark.parametrize("preset, kv_cache_dtype", [("k31-tiny", "auto"), ("k31-tiny", "fp8"),
                                                    ("kimi-linear-tiny", "auto"), ("deepseek-v32-tiny", "int8")])
def test_a_request_moves_bit_for_bit_and_as_accounted(make_checkpoint, preset, kv_cache_dtype):
    path = make_checkpoint(preset)
    prompt = random_prompts([37], seed=2, high=1000)[0]
    src, dst = (make_llm(path, kv_cache_dtype=kv_cache_dtype) for _ in range(2))
    req = _running_request(src, prompt)
    a, b = src.engine.core, dst.engine.core
    payload = export_kv(a.pages, a.states, req.block_ids, req.state_slot, prompt)
    assert payload.nbytes == transfer_bytes(a.config, a.pages, len(prompt))
    assert any(t.abs().sum() > 0 for t in (payload.tensors[STATE_RECURRENT], payload.tensors[STATE_CONV])) \
        or not a.config.kda_layers
    check_format(cache_format("m", a.pages, a.states), cache_format("m", b.pages, b.states))
    frames = encode_message({"kind": "payload", "num_tokens": payload.num_tokens}, payload.tensors)
    header, tensors = decode_message([bytes(f) for f in frames], max_bytes=payload.nbytes)
    assert header == {"kind": "payload", "num_tokens": len(prompt)}
    with pytest.raises(KVTransferError, match="other tokens than this prompt's first 37"):
        import_kv(payload, b.pages, b.states, [0, 1, 2], 0, prompt[:-1] + [prompt[-1] + 1])
    blocks = b.pages.allocate(b.pages.blocks_needed(len(prompt)))
    slot = b.states.allocate()
    import_kv(type(payload)(header["num_tokens"], tensors, payload.tokens), b.pages, b.states, blocks, slot, prompt)
    for name, t in a.pages.named_storage().items():
        assert torch.equal(b.pages.named_storage()[name][blocks], t[req.block_ids[:len(blocks)]]), name
    assert torch.equal(b.states.conv[slot], a.states.conv[req.state_slot])
    assert torch.equal(b.states.recurrent[slot], a.states.recurrent[req.state_slot])
    b.pages.free(blocks)
    b.states.free(slot)


def test_the_handshake_names_what_differs(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    plain, c8 = (make_llm(path, kv_cache_dtype=d).engine.core for d in ("auto", "fp8"))
    mine = cache_format("model-a", plain.pages, plain.states)
    with pytest.raises(KVTransferError, match="model is 'model-b'"):
        check_format(mine, cache_format("model-b", plain.pages, plain.states))
    with pytest.raises(KVTransferError, match="cache tensor 'index_keys.3' is \\['float8_e4m3fn'"):
        check_format(mine, cache_format("model-a", c8.pages, c8.states))
    bigger = make_llm(path, block_size=32).engine.core
    with pytest.raises(KVTransferError, match="block_size"):
        check_format(mine, cache_format("model-a", bigger.pages, bigger.states))


def test_a_payload_of_other_shapes_is_refused(make_checkpoint):
    core = make_llm(make_checkpoint("k31-tiny")).engine.core
    tokens = list(range(20))
    payload = export_kv(core.pages, core.states, core.pages.allocate(2), core.states.allocate(), tokens)
    payload.tensors[STATE_CONV] = payload.tensors[STATE_CONV][..., :1].contiguous()
    with pytest.raises(KVTransferError, match="state.conv"):
        import_kv(payload, core.pages, core.states, [0, 1], 0, tokens)
    with pytest.raises(KVTransferError, match="need 2 pages"):
        import_kv(payload, core.pages, core.states, [0], 0, tokens)


def test_malformed_messages_are_refused():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    frames = [bytes(f) for f in encode_message({"kind": "x"}, {"t": t})]
    header, back = decode_message(frames, max_bytes=12)
    assert header == {"kind": "x"} and torch.equal(back["t"], t)
    cases = [
        ([b"\xc1"], "not msgpack"),
        ([frames[0]], "one tensor per frame"),
        ([frames[0], frames[1][:-1]], "frame of 11 bytes"),
        ([msgpack.packb({"tensors": [["t", "object", [2]]]}), b"12"], "malformed"),
        ([msgpack.packb({"tensors": [["t", "uint8", [-1]]]}), b""], "malformed"),
        ([msgpack.packb({"tensors": [["t", "uint8", [2]], ["t", "uint8", [2]]]}), b"ab", b"cd"], "repeated"),
        (frames, "more than 11 bytes"),
    ]
    for bad, needle in cases:
        with pytest.raises(KVTransferError, match=needle):
            decode_message(bad, max_bytes=11 if needle.startswith("more") else 1 << 20)
