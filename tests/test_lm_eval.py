"""lm-evaluation-harness (`local-completions`, the client people point at a vLLM server) against a real
`deltaserve serve` of the embedded default model, on two small local tasks written here.

* Multiple choice: lm-eval scores every choice by the loglikelihood the server returns for `echo` + `logprobs`
  (the prompt's own logprobs). The test computes the same loglikelihoods directly from the model's cacheless forward
  (`reference_logits`) with lm-eval's context/continuation split, and both give the same accuracy, choice by choice.
  It runs once with the Hugging Face tokenizer of the model folder (`tokenizer.json`) and once with lm-eval's remote
  tokenizer (the server's `/tokenizer_info`, `/tokenize`, `/detokenize`).
* Generation: a `generate_until` task runs, and each generation is the engine's own greedy completion.
"""

from __future__ import annotations

import json

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager

from deltaserve import LLM, SamplingParams, load_model, load_tokenizer
from deltaserve.default_model import default_model_path
from server_utils import assert_all_free, run_server

# Python completions with one right continuation: what a model of the standard library can tell apart.
CHOICE_DOCS = [
    ("import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.",
     ["argv", "path", "stdin"], 0),
    ("class Error(Exception):\n    pass\n\n\ndef check(value):\n    if value is None:\n        raise",
     [" Error", " value", " pass"], 0),
    ("def __init__(self, name):\n        self.", ["name = name", "self = self", "value = 0"], 0),
    ("for i in range(len(items)):\n    print(items[", ["i])", "len])", "range])"], 0),
    ("try:\n    import json\nexcept", [" ImportError:", " json:", " import:"], 0),
    ('def read(path):\n    with open(path, "r") as', [" f:", " path:", " open:"], 0),
    ("    def __repr__(self):\n        return", [" '<%s>' % self.name", " None None", " import os"], 0),
    ("if __name__ ==", [' "__main__":', " 42:", " None:"], 0),
    ("    return self.", ["name", "return", "def"], 0),
    ("import", [" os", " def", " )"], 0),
]
GEN_DOCS = ["def fibonacci(n):\n", "import os\n\n\ndef listdir(path):\n", "class Stack:\n"]


def write_tasks(folder) -> None:
    with open(folder / "choices.jsonl", "w") as f:
        for ctx, choices, gold in CHOICE_DOCS:
            f.write(json.dumps({"ctx": ctx, "choices": choices, "gold": gold}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for ctx in GEN_DOCS:
            f.write(json.dumps({"ctx": ctx, "answer": ""}) + "\n")
    (folder / "ds_choices.yaml").write_text(f"""task: ds_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "choices.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (folder / "ds_gen.yaml").write_text(f"""task: ds_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{ctx}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
  temperature: 0
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def server():
    with run_server(default_model_path(), "--served-model-name", "deltaserve-default", "--dtype", "float32",
                    "--kv-cache-memory", "64MiB") as s:
        yield s


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(folder)
    return TaskManager(include_path=str(folder))


def reference_loglikelihoods() -> list[list[float]]:
    """Per doc and choice: the sum of the continuation's log-softmax under the cacheless fp32 forward, with
    lm-eval's split: trailing spaces of the context move to the continuation; the continuation's ids are those of
    the whole pair's encoding past the length of the context's own encoding, scored after the context's ids (so
    where BPE merges across the boundary, lm-eval scores a sequence no encoder writes, or nothing)."""
    model = load_model(default_model_path(), dtype="float32")
    tok = load_tokenizer(default_model_path())
    out = []
    for ctx, choices, _ in CHOICE_DOCS:
        scores = []
        for choice in choices:
            context, continuation = ctx.rstrip(), ctx[len(ctx.rstrip()):] + choice
            context_ids = tok.encode(context, allow_special=True)
            cont = tok.encode(context + continuation, allow_special=True)[len(context_ids):]
            whole = context_ids + cont
            with torch.no_grad():
                lp = model.reference_logits(torch.tensor(whole)).float().log_softmax(-1)
            scores.append(sum(lp[len(context_ids) - 1 + j, t].item() for j, t in enumerate(cont)))
        out.append(scores)
    return out


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_multiple_choice_accuracy_equals_the_reference(server, tasks, backend):
    args = {"model": "deltaserve-default", "base_url": server.url + "/v1/completions", "tokenizer_backend": backend,
            "tokenized_requests": True, "num_concurrent": 2}
    if backend == "huggingface":
        args["tokenizer"] = str(default_model_path())
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["ds_choices"],
                                      task_manager=tasks, log_samples=True, limit=None)
    samples = results["samples"]["ds_choices"]
    want = reference_loglikelihoods()
    assert len(samples) == len(CHOICE_DOCS)
    correct = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        got = [float(r[0]) for r in s["filtered_resps"]]
        ref = want[s["doc_id"]]
        assert got == pytest.approx(ref, abs=2e-3), (s["doc_id"], got, ref)
        assert any(g != 0.0 for g in got)  # real loglikelihoods, not the 0.0 an API without prompt logprobs gives
        correct += int(max(range(len(ref)), key=ref.__getitem__) == CHOICE_DOCS[s["doc_id"]][2])
    assert results["results"]["ds_choices"]["acc,none"] == pytest.approx(correct / len(CHOICE_DOCS))
    assert correct >= len(CHOICE_DOCS) // 2  # the model knows these idioms: a check that the scores mean something
    assert_all_free(server)


def test_generation_task_runs_and_matches_the_engine(server, tasks):
    args = {"model": "deltaserve-default", "base_url": server.url + "/v1/completions",
            "tokenizer_backend": "huggingface", "tokenizer": str(default_model_path())}
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["ds_gen"],
                                      task_manager=tasks, log_samples=True)
    samples = sorted(results["samples"]["ds_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(GEN_DOCS) and "exact_match,none" in results["results"]["ds_gen"]
    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    want = llm.generate(GEN_DOCS, SamplingParams(temperature=0, max_tokens=24, stop=["\n\n"]), use_tqdm=False)
    for s, w in zip(samples, want):
        assert s["resps"][0][0] == w.outputs[0].text, (s["resps"], w.outputs[0].text)
