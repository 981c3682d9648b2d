"""API edges of a real `deltaserve serve` (K3.1 tiny checkpoint, --api-key, small --max-model-len): /tokenize renders
chats exactly as chat completions do, truncate_prompt_tokens keeps the last k prompt tokens, /v1/models names the
served model rather than a path, and only the exact API key gets in."""

from __future__ import annotations

import httpx
import pytest

from server_utils import run_server, wait_until

MODEL = "edge-model"
KEY = "sk-edge-0123456789abcdef"
MAX_LEN = 1024
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("k31-tiny")


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, "--served-model-name", MODEL, "--kv-cache-memory", "32MiB", "--max-model-len",
                    str(MAX_LEN), "--shutdown-timeout", "5", api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize_chat(http: httpx.Client, **fields) -> list[int]:
    out = post(http, "/tokenize", {"messages": CHAT, **fields})
    assert out["count"] == len(out["tokens"])
    return out["tokens"]


def chat_prompt_tokens(http: httpx.Client, **fields) -> int:
    out = post(http, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1, **fields})
    return out["usage"]["prompt_tokens"]


def assert_pools_free(http: httpx.Client) -> None:
    def free():
        rep = http.get("/debug/integrity").json()
        return rep if rep["ok"] and rep["free_pages"] == rep["total_pages"] else None
    assert wait_until(free, 5.0, 0.1), http.get("/debug/integrity").text


# ------------------------------------------------------------------------------------------ /tokenize == chat
VARIANTS = {
    "plain": {},
    "tools": {"tools": TOOLS},
    "tools+required": {"tools": TOOLS, "tool_choice": "required"},
    "thinking-off": {"chat_template_kwargs": {"thinking": False}},
    "effort-low": {"chat_template_kwargs": {"thinking_effort": "low"}},
    "enable_thinking-off+tools": {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
    "reasoning_effort-medium": {"reasoning_effort": "medium"},
    "json_object": {"response_format": {"type": "json_object"}},
    "continue": {"messages": CHAT + [{"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
                 "continue_final_message": True},
}


def test_tokenize_counts_what_chat_completions_render(http):
    counts = {}
    for name, fields in VARIANTS.items():
        ids = tokenize_chat(http, **fields)
        assert len(ids) == chat_prompt_tokens(http, **fields), name
        counts[name] = ids
    # Each switch changes the rendering, so a /tokenize that ignored one would have failed the equality above.
    assert len({tuple(ids) for ids in counts.values()}) == len(counts)
    assert len(counts["tools"]) > len(counts["plain"]) and len(counts["thinking-off"]) < len(counts["plain"])
    # A continued final message ends with its own text, not with the closing markers or a generation prompt.
    assert http.post("/detokenize", json={"tokens": counts["continue"]}).json()["prompt"].endswith("It is")
    assert_pools_free(http)


def test_continued_message_goes_on_as_content(http):
    """Thinking is on by default, but a continued assistant message is in its response channel: the output is
    content, not reasoning."""
    messages = CHAT + [{"role": "assistant", "content": "It is"}]
    out = post(http, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                              "temperature": 0, "ignore_eos": True, "add_generation_prompt": False,
                                              "continue_final_message": True})
    assert out["choices"][0]["message"]["reasoning_content"] is None
    assert out["usage"]["prompt_tokens"] == len(tokenize_chat(http, messages=messages, add_generation_prompt=False,
                                                              continue_final_message=True))


def test_tokenize_prompt_matches_completion_usage(http):
    text = "Plain text with <|open|> spelled in it"
    ids = post(http, "/tokenize", {"prompt": text})["tokens"]
    out = post(http, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == len(ids)


# ------------------------------------------------------------------------------------ truncate_prompt_tokens
def greedy(http: httpx.Client, prompt, **fields) -> dict:
    return post(http, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True, **fields})


def test_truncate_prompt_tokens_completions(http):
    ids = post(http, "/tokenize", {"prompt": "The quick brown fox jumps over the lazy dog " * 3})["tokens"]
    assert len(ids) > 12
    cut = greedy(http, ids, truncate_prompt_tokens=7)
    assert cut["usage"]["prompt_tokens"] == 7
    # The engine saw exactly the last 7 tokens: same greedy text as sending them alone.
    assert cut["choices"][0]["text"] == greedy(http, ids[-7:])["choices"][0]["text"]
    text_prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert greedy(http, text_prompt, truncate_prompt_tokens=7)["usage"]["prompt_tokens"] == 7
    echoed = greedy(http, ids, truncate_prompt_tokens=7, echo=True, max_tokens=1)["choices"][0]["text"]
    assert echoed.startswith(http.post("/detokenize", json={"tokens": ids[-7:]}).json()["prompt"])
    # A prompt longer than the context fits once truncated; -1 keeps up to max_model_len and a k above the
    # length keeps everything.
    long_ids = (ids * (MAX_LEN // len(ids) + 2))[: MAX_LEN + 40]
    too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": long_ids, "max_tokens": 2})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    assert greedy(http, long_ids, truncate_prompt_tokens=100)["usage"]["prompt_tokens"] == 100
    assert greedy(http, ids, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(ids)
    assert greedy(http, ids, truncate_prompt_tokens=MAX_LEN)["usage"]["prompt_tokens"] == len(ids)
    assert_pools_free(http)


def test_truncate_prompt_tokens_chat_and_refusals(http):
    full = tokenize_chat(http)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": True}
    out = post(http, "/v1/chat/completions", {**body, "truncate_prompt_tokens": 6})
    assert out["usage"]["prompt_tokens"] == 6 < len(full)
    assert post(http, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == len(full)
    # The engine saw exactly the rendered chat's last 6 tokens: the same greedy tokens as a completion of them.
    chat_tokens = [t["token"] for t in out["choices"][0]["logprobs"]["content"]]
    alone = greedy(http, full[-6:], logprobs=0)["choices"][0]["logprobs"]["tokens"]
    assert chat_tokens == alone
    for path, body in (("/v1/completions", {"prompt": "hello"}), ("/v1/chat/completions", {"messages": CHAT})):
        for k, phrase in ((MAX_LEN + 1, "greater than max_model_len"), (0, "empty")):
            r = http.post(path, json={"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": k, **body})
            err = r.json()["error"]
            assert r.status_code == 400 and phrase in err["message"], r.text
            assert set(err) == {"message", "type", "param", "code"}
        r = http.post(path, json={"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": -2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    assert_pools_free(http)


# ---------------------------------------------------------------------------------------------- /v1/models
def test_models_root_is_the_served_name(http, checkpoint):
    r = http.get("/v1/models")
    assert r.status_code == 200
    card = r.json()["data"][0]
    assert card["id"] == MODEL and card["root"] == MODEL and card["max_model_len"] == MAX_LEN
    assert str(checkpoint) not in r.text and checkpoint.name not in r.text


# ------------------------------------------------------------------------------------------------- API key
def test_only_the_exact_api_key_gets_in(server):
    url = server.url + "/v1/models"
    wrong = [None, "", "Bearer", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}F",
             f"bearer {KEY}", f"Bearer  {KEY}", KEY, f"Bearer {'x' * len(KEY)}", "Bearer sk-édge".encode("latin-1")]
    for value in wrong:
        headers = {} if value is None else {"Authorization": value}
        r = httpx.get(url, headers=headers, timeout=30)
        assert r.status_code == 401, (value, r.text)
        assert r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_tokenize_returns_token_strings_when_asked(http, checkpoint):
    from deltaserve import load_tokenizer

    tok = load_tokenizer(checkpoint)
    plain = post(http, "/tokenize", {"prompt": "def f(x):\n    return x"})
    assert "token_strs" not in plain
    out = post(http, "/tokenize", {"prompt": "def f(x):\n    return x", "return_token_strs": True})
    assert out["tokens"] == plain["tokens"] and len(out["token_strs"]) == out["count"]
    assert out["token_strs"] == [tok.id_to_token(t) for t in out["tokens"]]
    assert b"".join(tok.id_to_bytes(t) for t in out["tokens"]) == b"def f(x):\n    return x"
    chat = post(http, "/tokenize", {"messages": CHAT, "return_token_strs": True})
    specials = [s for t, s in zip(chat["tokens"], chat["token_strs"]) if tok.is_special(t)]
    assert specials and all(s in tok.special_tokens for s in specials)
