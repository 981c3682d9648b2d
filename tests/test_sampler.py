"""SamplingParams validation and the batched Sampler (fast: CPU, tiny vocabularies)."""

import math

import msgpack
import pytest
import torch

from deltaserve.engine.sampler import Sampler, SampleOutput, SamplingState, TokenLogprobs
from deltaserve.engine.sampling_params import InvalidRequestError, SamplingParams
from deltaserve.errors import DeltaserveError

PROBS = [0.5, 0.3, 0.15, 0.05]


def _logits(values, rows=1):
    return torch.tensor([values] * rows, dtype=torch.float32)


def _states(params, rows, **kw):
    return [SamplingState(params, **kw) for _ in range(rows)]


def _counts(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).tolist()


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"seed": "7"}, "seed"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DeltaserveError)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seed": 2 ** 64}, "seed"),
        ({"seed": -(2 ** 63) - 1}, "seed"),
        ({"seed": 2 ** 64 - 1, "n": 2}, "seed"),
        ({"seed": 2 ** 64 - 3, "n": 4}, "seed"),
        ({"n": 2 ** 63}, "n"),
        ({"top_k": 2 ** 63}, "top_k"),
        ({"max_tokens": 2 ** 63}, "max_tokens"),
        ({"min_tokens": 2 ** 63, "max_tokens": None}, "min_tokens"),
        ({"stop_token_ids": [2 ** 64]}, "stop_token_ids"),
        ({"stop": ["ok", "\udfff"]}, "stop"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_unrepresentable_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and field in str(info.value)


def test_every_derived_seed_reaches_torch():
    # The engine seeds sample i with seed + i after the params crossed msgpack; the largest and smallest accepted
    # seeds must survive both.
    for n, seed in [(3, 2 ** 64 - 3), (1, 2 ** 64 - 1), (2, -(2 ** 63))]:
        p = SamplingParams(n=n, seed=seed)
        for i in range(n):
            assert msgpack.unpackb(msgpack.packb(p.seed + i)) == seed + i
            torch.Generator().manual_seed(p.seed + i)
    for beyond in (2 ** 64, -(2 ** 63) - 1):  # the range is exactly what both accept
        with pytest.raises(OverflowError):
            msgpack.packb(beyond)
        with pytest.raises(ValueError):
            torch.Generator().manual_seed(beyond)


def test_validate_catches_fields_changed_after_construction():
    p = SamplingParams(n=2, seed=1)
    p.seed = 2 ** 64 - 1
    with pytest.raises(InvalidRequestError) as info:
        p.validate()
    assert info.value.field == "seed"


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert (p.repetition_penalty, p.logprobs, p.stop, p.stop_token_ids) == (1.0, None, [], [])
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy
    p = SamplingParams(stop=["a"], stop_token_ids=[3])
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(4)
    assert p.stop == ["a"] and p.stop_token_ids == [3] and q == SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4])


# ---------------------------------------------------------------- greedy / filters


def test_greedy_is_argmax_with_lowest_id_tie_break():
    torch.manual_seed(0)
    logits = torch.randn(6, 37)
    logits[5, 3] = logits[5, 9] = logits[5].max() + 1.0
    out = Sampler(seed=0).sample(logits, _states(SamplingParams(temperature=0.0), 6))
    assert isinstance(out, SampleOutput)
    assert out.token_ids[:5] == logits[:5].argmax(-1).tolist()
    assert out.token_ids[5] == 3
    assert out.logprobs == [None] * 6


def test_input_logits_not_modified_and_tiny_temperature_is_finite():
    logits = torch.tensor([[1.0, 80.0, 79.0, -5.0]])
    before = logits.clone()
    st = SamplingState(SamplingParams(temperature=1e-6, repetition_penalty=1.3), prompt_token_ids=[1])
    out = Sampler(seed=0).sample(logits, [st])
    assert torch.equal(logits, before)
    assert out.token_ids == [2]  # 80 / 1.3 < 79: the penalised argmax, no NaN from the huge scale


def test_temperature_distribution():
    base = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15]).log()
    rows = 3000
    for temp in (1.0, 2.0, 0.5):
        out = Sampler(seed=1).sample(base.repeat(rows, 1), _states(SamplingParams(temperature=temp), rows))
        expected = torch.softmax(base / temp, dim=-1) * rows
        observed = torch.tensor(_counts(out.token_ids, 5), dtype=torch.float32)
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 25.0, (temp, observed.tolist(), expected.tolist())  # 4 dof: p ~ 5e-5


def test_top_k_one_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    out = Sampler(seed=0).sample(logits, _states(SamplingParams(temperature=1.5, top_k=1), 64))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_only_k_best():
    logits = _logits([1.0, 3.0, 2.5, 0.0, 2.9], rows=400)
    out = Sampler(seed=0).sample(logits, _states(SamplingParams(top_k=2), 400))
    assert set(out.token_ids) == {1, 4}


@pytest.mark.parametrize("top_p, allowed", [(1e-3, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_prefix(top_p, allowed):
    logits = _logits(torch.tensor(PROBS).log().tolist(), rows=600)
    out = Sampler(seed=0).sample(logits, _states(SamplingParams(top_p=top_p), 600))
    assert set(out.token_ids) == allowed


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = _logits(torch.tensor(PROBS).log().tolist(), rows=600)
    # threshold 0.5 * 0.5 = 0.25: tokens 0 (0.5) and 1 (0.3) survive.
    out = Sampler(seed=0).sample(logits, _states(SamplingParams(min_p=0.5), 600))
    assert set(out.token_ids) == {0, 1}
    counts = _counts(out.token_ids, 4)
    assert abs(counts[0] / 600 - 0.5 / 0.8) < 0.08  # renormalised over the survivors


# ---------------------------------------------------------------- seeds


def _run(seeded_pos, others, steps=20, vocab=50):
    """Drive one seed=1234 request for `steps` steps, batched with `others`; returns its tokens."""
    g = torch.Generator().manual_seed(99)
    target = SamplingState(SamplingParams(seed=1234, temperature=0.9, top_p=0.95))
    states = [SamplingState(p) for p in others]
    states.insert(seeded_pos, target)
    sampler = Sampler()  # unseeded shared generator: neighbours differ from run to run
    for _ in range(steps):
        logits = torch.randn(len(states), vocab, generator=g)
        logits[seeded_pos] = torch.linspace(-2, 2, vocab)  # the target's logits are fixed
        out = sampler.sample(logits, states)
        for s, t in zip(states, out.token_ids):
            s.append(t)
    return target.output_token_ids


def test_seeded_sampling_reproducible_and_batch_independent():
    alone = _run(0, [])
    assert alone == _run(0, [])
    assert len(set(alone)) > 1  # really random, not stuck
    mixed = [SamplingParams(), SamplingParams(seed=7, top_k=5), SamplingParams(temperature=0), SamplingParams(min_p=0.1)]
    assert _run(2, mixed) == alone
    assert _run(4, mixed[::-1]) == alone


def test_unseeded_rows_vary():
    logits = torch.zeros(1, 1000)
    a = [Sampler().sample(logits, [SamplingState(SamplingParams())]).token_ids[0] for _ in range(10)]
    assert len(set(a)) > 1
    s = Sampler()
    b = [s.sample(logits, [SamplingState(SamplingParams())]).token_ids[0] for _ in range(10)]
    assert len(set(b)) > 1


# ---------------------------------------------------------------- penalties / min_tokens


RAW = [2.0, -1.0, 0.5, 3.0, 0.0, 1.0]


def _full_logprobs(params, prompt=(), output=(), logits=RAW, mode="penalized"):
    """Return the step's full log-distribution via logprobs=V (V <= 20)."""
    params.logprobs = len(logits)
    st = SamplingState(params, prompt_token_ids=prompt, output_token_ids=list(output))
    rep = Sampler(seed=0, logprobs_mode=mode).sample(_logits(logits), [st]).logprobs[0]
    full = torch.empty(len(logits))
    for tid, lp in rep.top:
        full[tid] = lp
    return full


def test_repetition_penalty_formula():
    got = _full_logprobs(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0], output=[1, 1])
    expected = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, 1.0])  # positive / 2, negative * 2, others as-is
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_frequency_presence_penalty_formula_uses_outputs_only():
    got = _full_logprobs(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[0, 0], output=[3, 3, 5])
    expected = torch.tensor(RAW)
    expected[3] -= 2 * 0.5 + 0.25
    expected[5] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_penalties_combined_and_raw_mode_ignores_them():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=-0.5)
    got = _full_logprobs(params, prompt=[1], output=[0, 0])
    expected = torch.tensor(RAW)
    expected[0] = 2.0 / 1.5 - 2 * 1.0 + 0.5
    expected[1] = -1.0 * 1.5
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))
    raw = _full_logprobs(params.clone(), prompt=[1], output=[0, 0], mode="raw")
    torch.testing.assert_close(raw, torch.log_softmax(torch.tensor(RAW), -1))


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = _logits([5.0, 4.0, 3.0, 0.0])  # eos=0 best, stop id 1 next
    for ignore_eos in (False, True):
        st = SamplingState(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=ignore_eos,
                                          logprobs=0), eos_token_id=0)
        assert st.stop_ids_for_min_tokens == {0, 1}
        sampler, tokens = Sampler(seed=0), []
        for _ in range(3):
            out = sampler.sample(logits, [st])
            tokens.append(out.token_ids[0])
            st.append(out.token_ids[0])
        assert tokens == [2, 2, 0]
    # While masked, the blocked ids report -inf (the logprobs see the masked logits).
    st = SamplingState(SamplingParams(min_tokens=1, logprobs=4), eos_token_id=[0, 1])
    rep = Sampler(seed=0).sample(logits, [st]).logprobs[0]
    assert dict(rep.top)[0] == -math.inf and dict(rep.top)[1] == -math.inf and rep.token_id in (2, 3)


# ---------------------------------------------------------------- logprobs


def test_logprobs_sampled_top_and_rank():
    torch.manual_seed(3)
    logits = torch.randn(8, 30)
    params = [SamplingParams(logprobs=5, temperature=1.3), SamplingParams(logprobs=3, temperature=0),
              SamplingParams(logprobs=0), SamplingParams()] * 2
    out = Sampler(seed=0).sample(logits, [SamplingState(p) for p in params])
    ref = torch.log_softmax(logits, -1)  # temperature never enters the reported logprobs
    for i, (p, rep) in enumerate(zip(params, out.logprobs)):
        if p.logprobs is None:
            assert rep is None
            continue
        assert isinstance(rep, TokenLogprobs) and rep.token_id == out.token_ids[i]
        assert rep.logprob == pytest.approx(float(ref[i, rep.token_id]), abs=1e-6)
        assert rep.rank == int((ref[i] > ref[i, rep.token_id]).sum()) + 1
        assert len(rep.top) == p.logprobs
        values = [lp for _, lp in rep.top]
        assert values == sorted(values, reverse=True)
        expected_ids = ref[i].topk(p.logprobs).indices.tolist() if p.logprobs else []
        assert [t for t, _ in rep.top] == expected_ids
        if p.greedy:
            assert rep.rank == 1
    assert out.logprobs[2].top == []  # logprobs=0: only the sampled token
