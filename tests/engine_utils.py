"""Helpers for tests/test_engine.py: engines whose pools are checked after every step, a staggered-arrival driver,
and the one greedy oracle (`assert_same_greedy`) that compares engine tokens with an argmax loop over
`model.reference_logits`, tolerating a different choice only at a genuine near-tie.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltaserve import LLM, SamplingParams
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.state_slots import StateSlots
from deltaserve.distributed import Shard
from deltaserve.layers.linear import Linear

# A different greedy choice is accepted only where the engine's token is within this much of the reference's top
# logit. The tiny random models amplify fp32 summation-order noise to ~1e-4 on the logits (see
# tests/test_prefix_split.py::_tolerance), so a batch/chunking change may legitimately flip an argmax at a near-tie.
NEAR_TIE = 1e-3


# ------------------------------------------------------------------------------------------------ near-tie stats
@dataclass
class TieStats:
    """How many sequences one scenario checked and where a near-tie ended a comparison early."""

    name: str
    sequences: int = 0
    near_ties: list[str] = field(default_factory=list)
    min_gap: float = float("inf")  # smallest reference top-2 logit gap met on the verified tokens

    def assert_rare(self) -> None:
        """Near-tie divergences must stay rare, or the comparison would have no teeth."""
        assert self.sequences > 0, f"{self.name}: no sequence was checked"
        assert len(self.near_ties) < 0.1 * self.sequences, (
            f"{self.name}: {len(self.near_ties)} of {self.sequences} sequences diverged at a near-tie "
            f"(must be < 10%): {self.near_ties}")

    def summary(self) -> str:
        return (f"{self.name}: {len(self.near_ties)}/{self.sequences} near-tie divergences, smallest top-2 gap "
                f"{self.min_gap:.2g}" + (f" {self.near_ties}" if self.near_ties else ""))


ALL_STATS: list[TieStats] = []


def new_stats(name: str) -> TieStats:
    stats = TieStats(name)
    ALL_STATS.append(stats)
    return stats


# ------------------------------------------------------------------------------------------------- greedy oracle
@torch.inference_mode()
def assert_same_greedy(got_tokens: list[int], prompt: list[int], model, stats: TieStats | None = None,
                       banned: tuple[int, ...] | list[int] = (), min_tokens: int = 0) -> int:
    """Walk the greedy reference (argmax of `model.reference_logits`) along `got_tokens`.

    Every token must be the reference's argmax, except that where the engine's token is within NEAR_TIE of the
    reference's top logit (so the top-2 gap is < NEAR_TIE and the engine picked one of the near-tied top tokens)
    the divergence is accepted, recorded in `stats`, and the comparison stops there (later tokens follow a different
    context). `banned` ids get -inf while fewer than `min_tokens` tokens precede (the sampler's min_tokens mask).

    The reference is one causal full-sequence forward over prompt + got_tokens: row P-1+i is exactly the argmax
    loop's logits for step i as long as tokens 0..i-1 agreed, which is all this walk relies on.
    Returns how many tokens were verified (len(got_tokens) unless a near-tie ended the walk).
    """
    if stats is not None:
        stats.sequences += 1
    if not got_tokens:
        return 0
    prompt = [int(t) for t in prompt]
    logits = model.reference_logits(torch.tensor(prompt + [int(t) for t in got_tokens], dtype=torch.long)).float()
    P = len(prompt)
    for i, tok in enumerate(got_tokens):
        row = logits[P - 1 + i].clone()
        if i < min_tokens and banned:
            row[list(banned)] = float("-inf")
        top2 = row.topk(2)
        ref = int(top2.indices[0])
        if stats is not None:
            stats.min_gap = min(stats.min_gap, float(top2.values[0] - top2.values[1]))
        if tok == ref:
            continue
        gap = float(top2.values[0] - row[tok])
        where = f"prompt len {P}, step {i}: engine {tok}, reference {ref}, gap {gap:.3g}"
        if gap < NEAR_TIE:
            if stats is not None:
                stats.near_ties.append(where)
            return i
        raise AssertionError(f"greedy mismatch ({where}; reference top-2 gap "
                             f"{float(top2.values[0] - top2.values[1]):.3g}); got {got_tokens}")
    return len(got_tokens)


def assert_same_prefix(a: list[int], b: list[int], verified_a: int, verified_b: int) -> None:
    """Two engine runs of one prompt agree wherever both were verified against the reference."""
    k = min(verified_a, verified_b)
    assert a[:k] == b[:k], (a, b)
    if verified_a == len(a) and verified_b == len(b):
        assert a == b, (a, b)


# ---------------------------------------------------------------------------------------------------- engines
def assert_pools_free(engine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pages.num_free == engine.pages.num_blocks, (engine.pages.num_free, engine.pages.num_blocks)
    assert engine.states.num_free == engine.states.num_slots, (engine.states.num_free, engine.states.num_slots)


def make_llm(path, **kw) -> LLM:
    """An fp32 LLM whose engine checks both pools' integrity after every step() (and counts the steps)."""
    args = dict(max_num_seqs=16, max_num_batched_tokens=64, block_size=16, kv_cache_memory="8MiB",
                enable_chunked_prefill=True, dtype="float32", seed=0)
    args.update(kw)
    llm = LLM(model=str(path), **args)
    engine = llm.engine
    inner = engine.step
    engine.num_steps = 0

    def checked_step():
        out = inner()
        engine.num_steps += 1
        engine.check_integrity()
        return out

    engine.step = checked_step

    # Count what the model computes: total tokens forwarded, the largest step (tokens and requests).
    forward = engine.runner.forward
    engine.forward_tokens, engine.max_step_tokens, engine.max_step_requests = 0, 0, 0

    def counted_forward(plan):
        engine.forward_tokens += plan.num_tokens
        engine.max_step_tokens = max(engine.max_step_tokens, plan.num_tokens)
        engine.max_step_requests = max(engine.max_step_requests, len(plan.chunks))
        return forward(plan)

    engine.runner.forward = counted_forward

    # Record who gets preempted.
    preempt = engine.scheduler.preempt
    engine.preempted_ids = []

    def logged_preempt(req):
        engine.preempted_ids.append(req.request_id)
        preempt(req)

    engine.scheduler.preempt = logged_preempt
    return llm


def pool_bytes(config, num_slots: int, num_blocks: int, block_size: int, dtype=torch.float32,
               num_checkpoints: int = 2, shard: Shard = Shard()) -> int:
    """kv_cache_memory that `size_pools` splits into exactly num_slots state slots, num_blocks pages and (when
    the engine is made with max_state_checkpoints=num_checkpoints) that many prefix-cache state checkpoints (on
    every rank of a tensor-parallel group like `shard`)."""
    return ((num_slots + num_checkpoints) * StateSlots.bytes_per_slot(config, shard)
            + num_blocks * block_size * PagePool.bytes_per_token(config, dtype))


def drive(engine, arrivals: list[tuple[int, str, list[int], SamplingParams]], max_steps: int = 10_000) -> dict:
    """Add each (step, request_id, prompt, params) just before that step runs; step until every request finished.
    Returns request_id -> final RequestOutput (also of requests added before the call); the pools must be completely
    free at the end."""
    pending = sorted(arrivals, key=lambda a: a[0])
    done = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
        step += 1
        assert step < max_steps, "engine made no progress"
    assert {a[1] for a in arrivals} <= set(done)  # plus any request added before the call
    assert_pools_free(engine)
    return done


def bf16_runs_switched(path, flag: str, switch: str, seed: int, logprobs: int) -> list[list[tuple[list[int], list]]]:
    """Greedy bf16 runs of three random prompts (8 tokens each) with the engine flag `flag` on, then off; checks
    that the Linear modules' attribute `switch` follows the flag and that the pools end free. Returns, per run,
    (token ids, sampled-token logprobs) per prompt."""
    prompts = random_prompts([9, 30, 17], seed=seed, high=700)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=logprobs)
    runs = []
    for on in (True, False):
        llm = make_llm(path, dtype="bfloat16", **{flag: on})
        assert any(getattr(m, switch) for m in llm.engine.model.modules() if isinstance(m, Linear)) == on
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs])
        assert_pools_free(llm.engine)
    return runs


def random_prompts(lengths: list[int], seed: int, high: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def with_mtp_copies(path, out, count: int):
    """A copy of checkpoint folder `path` in `out` whose one MTP layer is repeated `count` times (layers L ..
    L + count - 1 all hold layer L's tensors, num_nextn_predict_layers = count): a checkpoint with several trained MTP
    layers, each drafting as well as the first one does at its own depth."""
    path, out = Path(path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["num_nextn_predict_layers"] == 1
    L = text["num_hidden_layers"]
    text["num_nextn_predict_layers"] = count
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    first = f"model.layers.{L}."
    for name in [n for n in tensors if first in n]:
        for j in range(1, count):
            tensors[name.replace(first, f"model.layers.{L + j}.")] = tensors[name].clone()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out
