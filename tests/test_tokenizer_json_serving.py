"""A checkpoint whose only tokenizer file is tokenizer.json (docs/chat.md §1.8) gives the ids and the greedy output of
the same checkpoint with tiktoken.model, offline and through `deltaserve serve`; GET /tokenizer_info (docs/serving.md
§10) answers through a real server behind --api-key, and the calls lm-evaluation-harness' remote tokenizer makes
(/tokenizer_info, /tokenize with add_special_tokens false, /detokenize) work as it reads them."""

from __future__ import annotations

import shutil

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.chat import render_chat
from deltaserve.server.parsers import parser_for
from deltaserve.server.tokenizer_info import tokenizer_info
from deltaserve.tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer
from server_utils import run_server
from tokenizer_strings import STRINGS

KEY = "sk-tokjson-0123456789"
PROMPTS = ["def fibonacci(n):", "中文English混合 and <|im_end|> typed as text", "x = {'a': [1, 2, 3]}\n\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris? <|im_end|>"}]
GREEDY = dict(temperature=0, max_tokens=12)


def json_only(src, dest):
    """A copy of checkpoint `src` without tiktoken.model."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("tiktoken.model"))
    return dest


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint, tmp_path_factory):
    """(the make-model checkpoint the server tests use, a copy of it without tiktoken.model)."""
    src = make_checkpoint("kimi-linear-tiny")
    return src, json_only(src, tmp_path_factory.mktemp("json_only") / "model")


@pytest.fixture(scope="module")
def reference(checkpoints):
    return LLM(str(checkpoints[0]), kv_cache_memory="32MiB")


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "deepseek-v32-tiny"])
def test_offline_llm_on_tokenizer_json_alone(make_checkpoint, tmp_path, preset):
    src = make_checkpoint(preset)
    reference = LLM(str(src), kv_cache_memory="32MiB")
    llm = LLM(str(json_only(src, tmp_path / "model")), kv_cache_memory="32MiB")
    assert isinstance(llm.tokenizer, HFTokenizer) and isinstance(reference.tokenizer, TiktokenTokenizer)
    for text in STRINGS:
        assert llm.tokenizer.encode(text) == reference.tokenizer.encode(text)
    assert llm.engine.core.eos_ids == reference.engine.core.eos_ids
    params = SamplingParams(**GREEDY)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    chat_got, chat_want = llm.chat(CHAT, params, use_tqdm=False)[0], reference.chat(CHAT, params, use_tqdm=False)[0]
    assert chat_got.prompt_token_ids == chat_want.prompt_token_ids
    assert chat_got.outputs[0].token_ids == chat_want.outputs[0].token_ids


@pytest.fixture(scope="module")
def server(checkpoints):
    with run_server(checkpoints[1], "--kv-cache-memory", "32MiB", "--max-model-len", "2048", "--shutdown-timeout",
                    "5", api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


def test_served_tokenizer_json_checkpoint_generates_as_tiktoken(http, checkpoints, reference):
    tok = reference.tokenizer
    for text in PROMPTS + STRINGS[:20]:
        r = http.post("/tokenize", json={"prompt": text})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode(text, allow_special=True)
    want = reference.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, want):
        r = http.post("/v1/completions", json={"prompt": prompt, **GREEDY})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == ref.outputs[0].text and choice["finish_reason"] == ref.outputs[0].finish_reason
        assert r.json()["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)
    no_thinking = {"messages": CHAT, "chat_template_kwargs": {"thinking": False}}
    chat_ids = http.post("/tokenize", json=no_thinking).json()["tokens"]
    assert chat_ids == render_chat(tok, reference.engine.config, CHAT, thinking=False)
    chat = http.post("/v1/chat/completions", json={**no_thinking, **GREEDY})
    assert chat.status_code == 200, chat.text
    ref_ids = reference.generate([chat_ids], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    parsed = parser_for(reference.engine.config, tok).parse(ref_ids, False)
    message = chat.json()["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == (parsed.content, parsed.reasoning_content)
    assert chat.json()["usage"]["completion_tokens"] == len(ref_ids)


def test_tokenizer_info_needs_the_key(server):
    r = httpx.get(server.url + "/tokenizer_info", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = httpx.get(server.url + "/tokenizer_info", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401


def test_tokenizer_info_as_lm_eval_reads_it(http, checkpoints):
    """lm-evaluation-harness 0.4.13 `check_remote_tokenizer_support` and `RemoteTokenizer`: a JSON object with
    `eos_token`; `bos_token`, `pad_token`, `chat_template`; /tokenize {"prompt", "add_special_tokens": false} ->
    {"tokens"}; /detokenize {"tokens"} -> {"prompt"}."""
    tok = load_tokenizer(checkpoints[0])
    r = http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert isinstance(info, dict) and info["eos_token"] == "<|im_end|>"
    assert (info["bos_token"], info["pad_token"], info["unk_token"]) == ("[BOS]", "[PAD]", "[UNK]")
    assert info["chat_template"] == tok.chat_template and "im_middle" in info["chat_template"]
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["model_max_length"] == tok.model_max_length
    assert info["added_tokens_decoder"][str(tok.eos_token_id)] == "<|im_end|>"  # AddedToken objects flattened
    test = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert test.status_code == 200 and isinstance(test.json()["tokens"], list)
    for text in STRINGS[:40]:
        ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert ids == tok.encode(text, allow_special=True)
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    # RemoteTokenizer.eos_token_id is encode(eos_token)[0]: /tokenize encodes special spellings as their ids, as
    # /v1/completions and a Hugging Face tokenizer do
    eos_ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos_ids == [tok.eos_token_id]


def test_tokenizer_info_fields(make_checkpoint, tmp_path):
    """K3 has no Jinja template (its renderer is code): chat_template is null. A tokenizer.json folder without
    tokenizer_config.json names no tokens; the class is then deltaserve's."""
    k3 = load_tokenizer(make_checkpoint("k31-tiny"))
    info = tokenizer_info(k3).model_dump()
    assert info["chat_template"] is None and info["eos_token"] == "<|end_of_msg|>"
    assert info["added_tokens_decoder"][str(k3.bos_token_id)] == "[BOS]"
    assert set(info) >= {"tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "model_max_length",
                         "chat_template", "additional_special_tokens", "clean_up_tokenization_spaces"}
    shutil.copyfile(make_checkpoint("k31-tiny") / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = tokenizer_info(load_tokenizer(tmp_path)).model_dump()
    assert bare == {"tokenizer_class": "HFTokenizer", "bos_token": None, "eos_token": None, "pad_token": None,
                    "unk_token": None, "model_max_length": None, "chat_template": None}
