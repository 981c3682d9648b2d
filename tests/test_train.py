"""deltaserve.tools.train: a few steps of a tiny K3.1 config lower the loss, are deterministic for a fixed seed,
and resume from a checkpoint exactly; the BPE trainer's export loads through the normal tokenizer path."""

import json
import math

import pytest
import torch

import deltaserve
from deltaserve.default_model import default_model_path
from deltaserve.tools import corpus
from deltaserve.tools.presets import _TINY, k3_config, k3_text_config
from deltaserve.layers.batch import StepBatch
from deltaserve.layers.moe import Router
from deltaserve.tools.train import (IndexerInputs, LoadBalancer, attention_mass, average_models, build_model,
                                   check_header_completion, evaluate, expert_load, export_model, function_body,
                                   header_prompt, indexer_loss, indexer_recall, load_initial_weights, mtp_agreement,
                                   mtp_loss, report, step_batch, train)

NUM_BPE = 4096 - 256  # the shipped tokenizer's size, so its ids feed the tiny model
STEPS, BATCH, SEQ = 12, 2, 64  # SEQ > index_topk: DSA selection is active


def _tiny_config() -> dict:
    text = k3_text_config(**{**_TINY, "mtp": 1}, vocab=NUM_BPE + 256, num_bpe=NUM_BPE)
    return k3_config(text, indexer={"heads": 4, "head_dim": 16, "topk": 16}, num_bpe=NUM_BPE)


@pytest.fixture(scope="module")
def tokens():
    tok = deltaserve.load_tokenizer(default_model_path())
    return torch.tensor(tok.encode(corpus.validation_text()[:20_000]), dtype=torch.long)


def _run(tokens, seed, steps=STEPS, state_path=None, model=None, stop_at=None):
    if model is None:
        model, _ = build_model(_tiny_config(), seed)
    res = train(model, tokens, steps=steps, batch=BATCH, seq_len=SEQ, lr=1e-2, seed=seed, warmup=2,
                state_path=state_path, ckpt_every=5 if state_path else 0, stop_at=stop_at, progress=False)
    return model, res


def test_loss_goes_down_and_is_deterministic(tokens):
    probe = tokens[: 4 * SEQ + 1]
    model_a, _ = build_model(_tiny_config(), 0)
    before = evaluate(model_a, probe, seq_len=SEQ, max_tokens=4 * SEQ)
    model_a, res_a = _run(tokens, 0, model=model_a)
    after = evaluate(model_a, probe, seq_len=SEQ, max_tokens=4 * SEQ)
    assert after < before - 0.3, (before, after)
    assert sum(res_a["losses"][-2:]) < sum(res_a["losses"][:2])
    model_b, res_b = _run(tokens, 0)
    assert res_a["losses"] == res_b["losses"]
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), name
    _, res_c = _run(tokens, 1)
    assert res_c["losses"] != res_a["losses"]


def test_mtp_loss_scores_the_token_after_next_per_window(tokens):
    """mtp_loss over two flattened windows = each window alone by hand: the MTP layer at position t reads token t's
    embedding and the main state at t - 1 (zero at 0) and is scored on token t + 1, from t = 1; a shift that leaked
    across windows, or the wrong target, changes it."""
    model, _ = build_model(_tiny_config(), 0)
    windows = torch.stack([tokens[:SEQ + 1], tokens[100:101 + SEQ]])
    x, y = windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)
    with torch.no_grad():
        got = mtp_loss(model, x, y, model(x, step_batch(2, SEQ)), step_batch(2, SEQ), SEQ)
        (layer,) = model.mtp
        parts = []
        for w in windows:
            one = StepBatch.single(SEQ)
            h = model(w[:-1], one)
            back = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
            out = layer(model.embed_tokens(w[:-1]), back, one.positions, one)
            parts.append(torch.nn.functional.cross_entropy(layer.logits(out)[1:], w[2:], reduction="sum"))
    want = sum(parts) / (2 * (SEQ - 1))
    assert torch.allclose(got, want, rtol=1e-5), (got, want)


def test_training_lowers_the_mtp_loss(tokens):
    _, res = _run(tokens, 0)
    assert len(res["mtp_losses"]) == STEPS and sum(res["mtp_losses"][-2:]) < sum(res["mtp_losses"][:2])


def test_mtp_agreement_compares_drafts_with_greedy_tokens(tokens):
    """mtp_agreement by hand on one window: the MTP layer's argmax at t from (state t - 1, token t) against the
    main argmax at t, t >= 1."""
    model, _ = build_model(_tiny_config(), 0)
    with torch.no_grad():
        one = StepBatch.single(SEQ)
        x = tokens[:SEQ]
        h = model(x, one)
        layer = model.mtp[0]
        draft = layer.logits(layer(model.embed_tokens(x), torch.cat([torch.zeros_like(h[:1]), h[:-1]]),
                                   one.positions, one)).argmax(-1)
        want = (draft[1:] == model.compute_logits(h).argmax(-1)[1:]).float().mean().item()
    assert mtp_agreement(model, tokens, SEQ, 1) == pytest.approx(want)


def test_indexer_loss_trains_only_the_indexer(tokens):
    """The KL term's gradient reaches the lightning indexers and nothing else (their inputs are detached), the
    attention mass it targets is each query's causal distribution, and training lowers it."""
    model, _ = build_model(_tiny_config(), 0)
    inputs = IndexerInputs(model)
    model.train()
    model(tokens[:2 * SEQ], step_batch(2, SEQ))
    taken = inputs.take()
    assert len(taken) == len(inputs.layers) > 0 and not inputs.take()
    layer, x = taken[0]
    q_nope, q_pe, rows, _, _ = layer._project(x, step_batch(2, SEQ))
    p = attention_mass(layer, q_nope, q_pe, rows, SEQ)
    assert torch.allclose(p.sum(-1), torch.ones(2, SEQ)) and not p.triu(1).any()
    loss = indexer_loss(taken, step_batch(2, SEQ), SEQ)
    assert loss.item() > 0
    loss.backward()
    moved = {n for n, q in model.named_parameters() if q.grad is not None and q.grad.abs().sum() > 0}
    assert moved and all(".indexer." in n for n in moved), sorted(moved)
    inputs.close()
    _, res = _run(tokens, 0)
    assert len(res["indexer_losses"]) == STEPS and sum(res["indexer_losses"][-2:]) < sum(res["indexer_losses"][:2])


def test_indexer_loss_raises_the_recall_of_attention_mass(tokens):
    """On a fixed model, fitting only the indexers to the KL makes their top-k keep more of each query's attention
    mass at a context past the top-k."""
    model, _ = build_model(_tiny_config(), 0)
    window = tokens[:4 * SEQ]
    before = indexer_recall(model, window, 4 * SEQ)
    inputs = IndexerInputs(model)
    model.train()
    with torch.no_grad():
        model(window, step_batch(1, 4 * SEQ))
    taken = inputs.take()
    inputs.close()
    params = [q for m, _ in taken for q in m.indexer.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        indexer_loss(taken, step_batch(1, 4 * SEQ), 4 * SEQ).backward()
        opt.step()
    after = indexer_recall(model, window, 4 * SEQ)
    # a fresh model attends nearly evenly, so even the best 16 keys hold a small share: the gain is what counts
    assert 0 < before and after > before + 0.03 and after <= 1, (before, after)


def test_load_balancer_moves_biases_against_the_load(tokens):
    model, _ = build_model(_tiny_config(), 0)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    balancer = LoadBalancer(model, 0.01)
    start = {id(r): r.e_score_correction_bias.clone() for r in routers}
    model.train()
    picks = {id(r): [] for r in routers}
    hooks = [r.register_forward_hook(lambda r, i, o: picks[id(r)].append(o.experts)) for r in routers]
    with torch.no_grad():
        model(tokens[:2 * SEQ], step_batch(2, SEQ))
    for hook in hooks:
        hook.remove()
    worst = balancer.step()
    expected_worst = 1.0
    assert any(picks.values())
    for r in routers:
        if not picks[id(r)]:  # the MTP layer's router: not in the main forward, so not moved
            assert torch.equal(r.e_score_correction_bias, start[id(r)])
            continue
        load = torch.bincount(torch.cat(picks[id(r)]).reshape(-1), minlength=r.e_score_correction_bias.numel()).float()
        moved = r.e_score_correction_bias - start[id(r)]
        assert torch.allclose(moved, 0.01 * torch.sign(load.mean() - load), atol=1e-7), (moved, load)
        expected_worst = max(expected_worst, (load.max() / load.mean()).item())
    assert worst == pytest.approx(expected_worst) and worst > 1
    model.eval()  # evaluation forwards do not count
    with torch.no_grad():
        model(tokens[:SEQ], step_batch(1, SEQ))
    before = [r.e_score_correction_bias.clone() for r in routers]
    assert balancer.step() == 1.0
    assert all(torch.equal(b, r.e_score_correction_bias) for b, r in zip(before, routers))
    balancer.close()


def test_resume_matches_uninterrupted(tokens, tmp_path):
    state = tmp_path / "state.safetensors"
    _, full = _run(tokens, 0)
    _run(tokens, 0, state_path=state, stop_at=8)  # interrupted after step 8 (checkpoint at 5 and 8)
    model, resumed = _run(tokens, 0, steps=STEPS, state_path=state)
    assert resumed["step"] == STEPS
    for key in ("losses", "mtp_losses", "indexer_losses", "load_imbalance"):  # MTP, indexers, biases resume too
        assert resumed[key] == full[key], key


def test_a_new_stage_starts_from_a_state_or_a_model_folder(tokens, tmp_path):
    """--init: the weights of a run's state or of its exported folder, exactly (fp32 export), with what they had
    seen; training then starts afresh (step 0, new optimiser) from there, not from a random model."""
    state = tmp_path / "state.safetensors"
    trained, _ = _run(tokens, 0, state_path=state, stop_at=10)
    seen = {"step": 10, "tokens_seen": 10 * BATCH * SEQ}
    folder = export_model(trained, build_model(_tiny_config(), 0)[1], _tiny_config(), default_model_path(),
                          tmp_path / "m", dtype=torch.float32, extra=seen)
    for source in (state, folder):
        model, _ = build_model(_tiny_config(), 1)
        assert load_initial_weights(model, [source]) == [{"from": source.name, **seen}]
        expected = trained.state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()), source
    _, fresh = _run(tokens, 1)
    _, continued = _run(tokens, 1, model=model)
    assert len(continued["losses"]) == STEPS and continued["losses"][0] < fresh["losses"][0] - 0.5


def test_a_stage_from_several_sources_starts_from_their_mean(tokens, tmp_path):
    """--init A B and --average A B (a model soup): the mean of the sources' weights, each source recorded; the
    averaged folder loads through the normal path with the first folder's config and tokenizer."""
    state = tmp_path / "state.safetensors"
    first, _ = _run(tokens, 0, state_path=state, stop_at=4)
    second, _ = _run(tokens, 1, steps=6)
    folders = [export_model(m, build_model(_tiny_config(), 0)[1], _tiny_config(), default_model_path(),
                            tmp_path / name, dtype=torch.float32, extra={"step": step, "tokens_seen": step * 5})
               for m, name, step in ((first, "a", 4), (second, "b", 6))]
    mean = {k: (v + second.state_dict()[k]) / 2 for k, v in first.state_dict().items()}
    assert any(not torch.equal(v, mean[k]) for k, v in first.state_dict().items())
    model, _ = build_model(_tiny_config(), 2)
    assert load_initial_weights(model, [state, folders[1]]) == [
        {"from": "state.safetensors", "step": 4, "tokens_seen": 4 * BATCH * SEQ},
        {"from": "b", "step": 6, "tokens_seen": 30}]
    assert all(torch.equal(v, mean[k]) for k, v in model.state_dict().items())
    out = average_models(folders, tmp_path / "soup")
    soup = deltaserve.load_model(out, dtype="float32").state_dict()
    assert all(torch.equal(v, mean[k]) for k, v in soup.items())
    record = json.loads((out / "training.json").read_text())["average_of"]
    assert [(r["from"], r["step"]) for r in record] == [("a", 4), ("b", 6)]
    assert deltaserve.load_tokenizer(out).encode("def f(x):") == deltaserve.load_tokenizer(folders[0]).encode(
        "def f(x):")


def test_export_loads_through_normal_path(tokens, tmp_path):
    raw = _tiny_config()
    model, config = build_model(raw, 0)
    src = default_model_path()
    out = export_model(model, config, raw, src, tmp_path / "m", dtype=torch.float32)
    loaded = deltaserve.load_model(out, dtype="float32")
    ids = tokens[:40]
    with torch.no_grad():
        ref = model.reference_logits(ids)
    assert torch.allclose(loaded.reference_logits(ids), ref, atol=1e-4, rtol=1e-4)
    assert json.loads((out / "config.json").read_text())["text_config"]["dsa_config"]["index_topk"] == 16
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_bpe_trainer_export_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    from deltaserve.tools.train import train_bpe_ranks, write_tokenizer

    text = corpus.validation_text()[:60_000]
    ranks = train_bpe_ranks([text], 700)
    assert len(ranks) == 700 and all(ranks[bytes([b])] == b for b in range(256))
    write_tokenizer(tmp_path, ranks, 4096)
    tok = deltaserve.load_tokenizer(tmp_path)
    for token, rank in ranks.items():
        assert tok.decode_bytes([rank]) == token
    ids = tok.encode(text[:5000])
    assert tok.decode(ids) == text[:5000]
    assert len(ids) < 0.5 * len(text[:5000].encode())  # the merges actually compress
    assert tok.encode("[BOS]", allow_special=True) == [700]


def test_expert_load_counts_what_the_routers_pick(tokens):
    """expert_load's figures are max/mean of the top-k picks the main stack's routers make (an eval forward), one
    per MoE layer of the main stack, and lie between 1 (even) and E / k (every token on the same k experts)."""
    model, config = build_model(_tiny_config(), 0)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    picks = {id(r): [] for r in routers}
    hooks = [r.register_forward_hook(lambda r, i, o: picks[id(r)].append(o.experts)) for r in routers]
    with torch.no_grad():
        model.eval()
        model(tokens[:3 * SEQ], step_batch(3, SEQ))
    for hook in hooks:
        hook.remove()
    expected = []
    for r in routers:
        if picks[id(r)]:
            load = torch.bincount(torch.cat(picks[id(r)]).reshape(-1), minlength=config.num_experts).float()
            expected.append((load.max() / load.mean()).item())
    figures = expert_load(model, tokens, seq_len=SEQ, windows=3)
    assert figures == pytest.approx(expected) and len(figures) >= 2
    assert all(1 <= f <= config.num_experts / config.num_experts_per_token for f in figures)


def test_report_reads_a_model_folder(tokens, tmp_path, monkeypatch):
    """The report's perplexities are `evaluate` over the whole validation and CPython test texts (the losses it
    computed are recorded rather than computed again: each pass over a whole text takes a while)."""
    from deltaserve.tools import train as train_module

    model, config = build_model(_tiny_config(), 0)
    train(model, tokens, steps=3, batch=BATCH, seq_len=SEQ, lr=1e-2, seed=0, warmup=1, progress=False)
    out = export_model(model, config, _tiny_config(), default_model_path(), tmp_path / "m", dtype=torch.float32)
    passes = []

    def recorded(model, ids, **kw):
        loss = evaluate(model, ids, **kw)
        passes.append((len(ids), kw.get("max_tokens"), loss))
        return loss

    monkeypatch.setattr(train_module, "evaluate", recorded)
    figures = report(out)
    tok = deltaserve.load_tokenizer(out)
    texts = [len(tok.encode(corpus.validation_text())), len(tok.encode(corpus.test_suite_text()))]
    assert [(n, m) for n, m, _ in passes] == [(n, n) for n in texts]  # whole texts, in that order
    assert figures["validation_ppl"] == pytest.approx(math.exp(passes[0][2]))
    assert figures["cpython_tests_ppl"] == pytest.approx(math.exp(passes[1][2]))
    assert 1 < figures["cpython_tests_ppl"] < math.inf
    assert 0 <= figures["mtp_greedy_agreement"] <= 1 and 0 < figures["indexer_recall_1k"] <= 1
    assert len(figures["expert_load_max_over_mean"]) >= 2


@pytest.mark.parametrize("completion, body, parses, repeats", [
    ("\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n", "def f(a):\n    return a + b\n", True, 1),
    (" return a + b\n\nclass X:\n", "def f(a): return a + b\n", True, 1),
    ("\n    if a:\n        return b\n    return a +", "def f(a):\n    if a:\n        return b\n", True, 1),
    ("\n    x = 1\n    x = 1\n    x = 1\n    x", "def f(a):\n    x = 1\n    x = 1\n    x = 1\n", True, 3),
    ("\n    # only a comment\n    # and another\nx = 1\n", "def f(a):\n    # only a comment\n    # and another\n",
     False, 1),
    ("\n    return (a +\n\nb = 2\n", "def f(a):\n    return (a +\n", False, 1),
    ("  # 38: 3894444444444", "def f(a):  # 38: 3894444444444\n", False, 0),
])
def test_header_completion_checks(completion, body, parses, repeats):
    """The function a completion defines ends at the first unindented line, or drops its last (maybe cut) line when
    the completion stops inside it; it must parse with a body; repeats count the completion's complete lines."""
    assert function_body("def f(a):", completion) == body
    assert check_header_completion("def f(a):", completion) == {"parses": parses, "max_line_repeats": repeats}
    if completion.startswith("\n"):  # the same with the newline in the prompt (`header_prompt`)
        assert check_header_completion(header_prompt("def f(a):"), completion[1:]) == {
            "parses": parses, "max_line_repeats": repeats}
