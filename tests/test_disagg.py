"""Prefill/decode disaggregation offline (docs/disaggregation.md): a prefill instance (kv_producer) computes each
prompt but its last token and keeps the cache; a decode instance (kv_consumer) pulls it over ZeroMQ on loopback,
loads it into its own pages and slot and decodes: the greedy tokens of one instance, the bytes of the accounting,
and every pool free on both sides afterwards — also when the prefill instance is gone."""

from __future__ import annotations

import time

import pytest

from deltaserve import SamplingParams
from deltaserve.disagg import transfer_bytes
from deltaserve.engine.sampling_params import InvalidRequestError
from deltaserve.errors import RequestFailedError
from engine_utils import assert_pools_free, greedy, make_llm, random_prompts

QUICK = {"handshake_timeout_s": 3, "transfer_timeout_s": 3, "hold_timeout_s": 30}


def _producer(path, role="kv_producer", **kw):
    return make_llm(path, kv_transfer_config={"kv_role": role}, **kw)


def _consumer(path, **kw):
    return make_llm(path, kv_transfer_config={"kv_role": "kv_consumer", "kv_connector_extra_config": QUICK}, **kw)


def _prefill(prefill, prompts) -> list[dict]:
    outs = prefill.generate(prompts, SamplingParams(temperature=0, max_tokens=1,
                                                    kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    return [o.kv_transfer_params for o in outs]


@pytest.mark.parametrize("preset, role, kw", [("k31-tiny", "kv_producer", {}), ("kimi-linear-tiny", "kv_both", {}),
                                              ("deepseek-v32-tiny", "kv_producer", {"kv_cache_dtype": "fp8"})])
def test_prefill_then_decode_gives_one_instance_tokens(make_checkpoint, preset, role, kw):
    """Prompts of 1 to 70 tokens (chunked on the prefill side, which may also be a kv_both instance), one decoded
    with n = 2 and one with logprobs: the tokens (and logprobs) of one instance; each transfer's bytes are the
    accounting's; nothing is held after."""
    path = make_checkpoint(preset)
    prompts = random_prompts([1, 2, 16, 17, 40, 70], seed=7, high=1000)
    params = [greedy(12) for _ in prompts]
    params[3] = greedy(12, n=2)
    params[4] = greedy(12, logprobs=2)
    single = make_llm(path, **kw)
    want = single.generate(prompts, params, use_tqdm=False)
    with _producer(path, role, max_num_batched_tokens=24, **kw) as prefill, _consumer(path, **kw) as decode:
        kv = _prefill(prefill, prompts)
        assert [k["num_tokens"] for k in kv] == [len(p) - 1 for p in prompts]
        p_core, d_core = prefill.engine.core, decode.engine.core
        assert p_core.kv_producer.num_held == len(prompts) - 1  # the one-token prompt leaves nothing to pull
        assert_pools_free(prefill.engine)  # the staged caches are copies: the pools are free at once
        for p, k in zip(params, kv):
            p.kv_transfer_params = k
        got = decode.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for a, b in zip(want[4].outputs[0].logprobs, got[4].outputs[0].logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
        accounted = sum(transfer_bytes(p_core.config, p_core.pages, len(p) - 1) for p in prompts if len(p) > 1)
        p_stats, d_stats = p_core.stats(), d_core.stats()
        assert p_stats["kv_transfers_sent"] == d_stats["kv_transfers_received"] == len(prompts) - 1
        assert p_stats["kv_transfer_bytes_sent"] == d_stats["kv_transfer_bytes_received"] == accounted
        assert p_stats["kv_transfers_held"] == 0 and d_stats["kv_transfers_in_flight"] == 0
        assert_pools_free(decode.engine)


def test_a_gone_or_forgetful_prefill_instance_fails_the_request_in_time(make_checkpoint):
    """A cache pulled for another prompt is refused when loaded; a pull of a transfer the producer no longer holds
    (pulled once already) fails at once naming it; one from a producer that is gone fails within the transfer
    timeout; the consumer serves a plain request meanwhile, and its pools end free."""
    path = make_checkpoint("k31-tiny")
    prompts = random_prompts([20, 30], seed=3, high=1000)
    with _consumer(path) as decode:
        prefill = _producer(path)
        kv = _prefill(prefill, prompts)
        other = prompts[0][:-2] + [prompts[0][-2] + 1, prompts[0][-1]]  # the same length, one token changed
        with pytest.raises(RequestFailedError, match="computed from other tokens"):
            decode.generate([other], greedy(4, kv_transfer_params=kv[0]), use_tqdm=False)
        with pytest.raises(RequestFailedError, match="is not held here"):
            decode.generate([prompts[0]], greedy(4, kv_transfer_params=kv[0]), use_tqdm=False)
        prefill.close()
        started = time.monotonic()
        with pytest.raises(RequestFailedError) as failed:
            decode.generate(prompts[::-1], [greedy(4, kv_transfer_params=kv[1]), greedy(4)], use_tqdm=False)
        assert time.monotonic() - started < QUICK["transfer_timeout_s"] + 5
        lost, plain = failed.value.outputs
        assert lost.error and "did not answer within" in lost.error
        assert lost.outputs[0].finish_reason == "error" and len(plain.outputs[0].token_ids) == 4
        stats = decode.engine.core.stats()
        failures = stats["kv_transfer_failures_by_stage"]
        assert failures["transfer"] == 2 and stats["kv_transfers_in_flight"] == 0
        assert stats["kv_transfers_received"] == failures["load"] == 1  # the other prompt's
        assert_pools_free(decode.engine)


def test_handshake_refuses_another_model(make_checkpoint):
    with _producer(make_checkpoint("k31-tiny")) as prefill, _consumer(make_checkpoint("k31-tiny", seed=1)) as decode:
        kv = _prefill(prefill, [list(range(1, 30))])[0]
        with pytest.raises(RequestFailedError, match="model is"):
            decode.generate([list(range(1, 30))], greedy(4, kv_transfer_params=kv), use_tqdm=False)
        assert decode.engine.core.stats()["kv_transfer_failures_by_stage"] == {"handshake": 1}
        assert_pools_free(decode.engine)


def test_requests_an_instance_cannot_take_are_refused_naming_why(make_checkpoint):
    path = make_checkpoint("k31-tiny")
    plain = make_llm(path)
    remote = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9, "transfer_id": "t",
              "num_tokens": 5}
    cases = [(plain, greedy(2, kv_transfer_params={"do_remote_decode": True}), "not a kv_producer"),
             (plain, greedy(2, kv_transfer_params=remote), "not a kv_consumer")]
    with _producer(path) as prefill, _consumer(path) as decode:
        cases += [(prefill, greedy(2, n=2, kv_transfer_params={"do_remote_decode": True}), "n = 1"),
                  (decode, greedy(2, prompt_logprobs=1, kv_transfer_params=remote), "prompt_logprobs"),
                  (decode, greedy(2, kv_transfer_params=dict(remote, num_tokens=9)), "below the prompt's 9")]
        for llm, params, needle in cases:
            with pytest.raises(InvalidRequestError, match=needle):
                llm.generate([list(range(1, 10))], params, use_tqdm=False)
    for bad, needle in [({"do_remote_decode": True, "do_remote_prefill": True}, "exclude each other"),
                        ({"do_remote_prefill": True, "num_tokens": 3}, "remote_host is missing"),
                        ({"do_remote_decode": 1}, "must be a bool")]:
        with pytest.raises(InvalidRequestError, match=needle):
            SamplingParams(kv_transfer_params=bad)


def test_the_decode_side_pulls_only_the_pages_it_has_not_cached(make_checkpoint):
    """A decode instance that has computed a prompt's first 48 tokens itself pulls only the pages past them (the
    bytes of the accounting from that page on) and gives one instance's tokens; when those cached pages are evicted
    before the payload arrives, it computes the prompt itself, with the same tokens."""
    path = make_checkpoint("k31-tiny")
    shared = random_prompts([48], seed=5, high=1000)[0]
    prompt = shared + random_prompts([20], seed=6, high=1000)[0]
    want = make_llm(path).generate([prompt], greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    with _producer(path) as prefill, _consumer(path) as decode:
        core = decode.engine.core
        decode.generate([shared + [7]], greedy(2), use_tqdm=False)  # its 3 full pages are now cached here
        kv = _prefill(prefill, [prompt, prompt])
        got = decode.generate([prompt], greedy(10, kv_transfer_params=kv[0]), use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want
        n = len(prompt) - 1
        assert core.stats()["kv_transfer_bytes_received"] == transfer_bytes(core.config, core.pages, n, 3) \
            < transfer_bytes(core.config, core.pages, n)
        decode.engine.add_request("again", prompt, greedy(10, kv_transfer_params=kv[1]))  # asks from page 4 on
        core.pages.free(core.pages.allocate(core.pages.num_free))  # every cached page evicted meanwhile
        tokens = []
        while decode.engine.has_unfinished_requests():
            tokens = [o.outputs[0].token_ids for o in decode.engine.step() if o.finished] or tokens
        assert tokens == [want] and core.stats()["kv_transfers_recomputed"] == 1
        assert_pools_free(decode.engine)


def test_an_image_prompt_moves_with_its_image(make_checkpoint):
    """A prompt holding an image (k3-tiny-vision): the prefill instance computes it with the image's features, the
    decode instance (given the same image) pulls its cache and gives one instance's tokens; the same kv params with
    another image of the same size are refused when loaded (the digest covers the images)."""
    import io

    from PIL import Image

    from deltaserve.errors import RequestFailedError
    from deltaserve.vision import IMAGE_PLACEHOLDER

    def png(colour):
        out = io.BytesIO()
        Image.new("RGB", (90, 70), colour).save(out, format="PNG")
        return out.getvalue()

    path = make_checkpoint("k3-tiny-vision")
    prompt = "look at " + IMAGE_PLACEHOLDER + " and say"
    red, blue = png((200, 30, 30)), png((30, 30, 200))
    want = make_llm(path).generate({"prompt": prompt, "multi_modal_data": {"image": [red]}}, greedy(8),
                                    use_tqdm=False)[0].outputs[0].token_ids
    with _producer(path) as prefill, _consumer(path) as decode:
        first = prefill.generate({"prompt": prompt, "multi_modal_data": {"image": [red]}},
                                 SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                                 use_tqdm=False)
        kv = [first[0].kv_transfer_params]
        first = prefill.generate({"prompt": prompt, "multi_modal_data": {"image": [red]}},
                                 SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                                 use_tqdm=False)
        kv.append(first[0].kv_transfer_params)
        got = decode.generate({"prompt": prompt, "multi_modal_data": {"image": [red]}},
                              greedy(8, kv_transfer_params=kv[0]), use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
        with pytest.raises(RequestFailedError, match="computed from other tokens"):
            decode.generate({"prompt": prompt, "multi_modal_data": {"image": [blue]}},
                            greedy(8, kv_transfer_params=kv[1]), use_tqdm=False)
        assert_pools_free(decode.engine)
