"""Hostile requests against a live `deltaserve serve`: every one gets an OpenAI-shaped 4xx naming the offending field,
none a 5xx, a reset connection or a broken stream; the server keeps serving and its pools end intact and free.

One module-scoped server with small limits and an API key serves the whole table (each case is cheap: it is refused
before the engine, or asks for a couple of tokens). tests/test_server.py::test_bad_inputs_get_openai_errors keeps its
own smaller table; the cases here are other ones.
"""

from __future__ import annotations

import json

import httpx
import pytest

from deltaserve import LLM, InvalidRequestError, SamplingParams

from server_utils import iter_sse, run_server, wait_until

MODEL = "tiny-hostile"
KEY = "sk-hostile"
MAX_MODEL_LEN = 256
MAX_BYTES = 16384
MAX_N = 4
MAX_PROMPTS = 4
MAX_QUEUE = 8
MAX_TOKENS_PER_REQUEST = 1000  # below n=4 full-context sequences (4 * 256)
SERVER_ARGS = ("--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--shutdown-timeout", "5",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_BYTES), "--max-n", str(MAX_N),
               "--max-prompts-per-request", str(MAX_PROMPTS), "--max-queue-len", str(MAX_QUEUE),
               "--max-tokens-per-request", str(MAX_TOKENS_PER_REQUEST))
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}

LONE = "\ud800"  # a lone surrogate: valid JSON ("\ud800"), not encodable as UTF-8
BIG = 2 ** 64  # one past what msgpack carries
P, C, T, D, R = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def body(**fields) -> bytes:
    """A JSON body as bytes; lone surrogates are written as JSON escapes and NaN / Infinity as Python's json does."""
    return json.dumps(fields).encode()


def comp(**fields) -> bytes:
    return body(**{"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})


def chat(**fields) -> bytes:
    return body(**{"model": MODEL, "messages": USER, "max_tokens": 2, **fields})


def resp(**fields) -> bytes:
    return body(**{"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields})


# (id, method, path, raw body or None, extra headers, expected status, expected param)
Case = tuple[str, str, str, bytes | None, dict, int, str | None]


def _post(name: str, path: str, raw: bytes, param: str | None, status: int = 400, headers: dict | None = None) -> Case:
    return name, "POST", path, raw, {**JSON, **(headers or {})}, status, param


def _surrogate_cases() -> list[Case]:
    """A lone surrogate in every kind of string of every request body: values, list entries, keys, nested parts."""
    return [
        _post("lone-prompt", P, comp(prompt=LONE), "prompt"),
        _post("lone-prompt-list", P, comp(prompt=["ok", "x" + LONE]), "prompt.1"),
        _post("lone-stop", P, comp(stop=LONE), "stop"),
        _post("lone-stop-list", P, comp(stop=["a", LONE]), "stop.1"),
        _post("lone-stop-stream", P, comp(stop=[LONE], stream=True), "stop.0"),
        _post("lone-cache-salt", P, comp(cache_salt=LONE), "cache_salt"),
        _post("lone-cache-salt-stream", P, comp(cache_salt=LONE, stream=True), "cache_salt"),
        _post("lone-model", P, comp(model=LONE), "model"),
        _post("lone-user", P, comp(user=LONE), "user"),
        _post("lone-request-id", P, comp(request_id=LONE), "request_id"),
        _post("lone-suffix", P, comp(suffix=LONE), "suffix"),
        _post("lone-unknown-field", P, comp(extra_thing=LONE), "extra_thing"),
        _post("lone-key", P, body(**{"model": MODEL, "prompt": "hi", LONE: 1}), None),
        _post("lone-nested-key", P, comp(kv_transfer_params={LONE: 1}), "kv_transfer_params"),
        _post("lone-nested-value", P, comp(kv_transfer_params={"a": [1, {"b": LONE}]}), "kv_transfer_params.a.1.b"),
        _post("lone-logit-bias-key", P, comp(logit_bias={LONE: 1.0}), "logit_bias"),
        _post("lone-chat-content", C, chat(messages=[USER[0], {"role": "user", "content": LONE}]),
              "messages.1.content"),
        _post("lone-chat-content-stream", C, chat(messages=[{"role": "user", "content": LONE}], stream=True),
              "messages.0.content"),
        _post("lone-content-part-text", C, chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": LONE}]}]), "messages.0.content.0.text"),
        _post("lone-content-part-type", C, chat(messages=[{"role": "user", "content": [{"type": LONE}]}]),
              "messages.0.content.0.type"),
        _post("lone-role", C, chat(messages=[{"role": LONE, "content": "hi"}]), "messages.0.role"),
        _post("lone-name", C, chat(messages=[{"role": "user", "content": "hi", "name": LONE}]), "messages.0.name"),
        _post("lone-reasoning", C, chat(messages=[USER[0], {"role": "assistant", "content": "a",
                                                            "reasoning_content": LONE}]),
              "messages.1.reasoning_content"),
        _post("lone-tool-call-id", C, chat(messages=[USER[0], {"role": "tool", "content": "r",
                                                               "tool_call_id": LONE}]), "messages.1.tool_call_id"),
        _post("lone-tool-call-args", C, chat(messages=[USER[0], {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": LONE}}]}]),
              "messages.1.tool_calls.0.function.arguments"),
        _post("lone-tool-name", C, chat(tools=[{"type": "function", "function": {"name": LONE}}]),
              "tools.0.function.name"),
        _post("lone-tool-description", C, chat(tools=[{"type": "function", "function": {
            "name": "f", "description": LONE}}]), "tools.0.function.description"),
        _post("lone-tool-param-key", C, chat(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {LONE: {"type": "string"}}}}}]),
              "tools.0.function.parameters.properties"),
        _post("lone-tool-choice", C, chat(tools=[TOOL], tool_choice={"type": "function", "function": {
            "name": LONE}}), "tool_choice.function.name"),
        _post("lone-response-format-name", C, chat(response_format={"type": "json_schema", "json_schema": {
            "name": LONE, "schema": {"type": "object"}}}), "response_format.json_schema.name"),
        _post("lone-template-kwarg", C, chat(chat_template_kwargs={"x": LONE}), "chat_template_kwargs.x"),
        _post("lone-template-kwarg-key", C, chat(chat_template_kwargs={LONE: 1}), "chat_template_kwargs"),
        _post("lone-reasoning-effort", C, chat(reasoning_effort=LONE), "reasoning_effort"),
        _post("lone-chat-stop", C, chat(stop=LONE), "stop"),
        _post("lone-chat-model", C, chat(model=LONE), "model"),
        _post("lone-tokenize-prompt", T, body(prompt=LONE), "prompt"),
        _post("lone-tokenize-messages", T, body(messages=[{"role": "user", "content": LONE}]), "messages.0.content"),
        _post("lone-tokenize-model", T, body(prompt="a", model=LONE), "model"),
        _post("lone-detokenize-model", D, body(tokens=[1], model=LONE), "model"),
    ]


def _encoding_cases() -> list[Case]:
    """Bytes that are not UTF-8, bodies that are not JSON objects, and content types that are not JSON."""
    good = comp()
    return [
        _post("utf8-invalid-in-prompt", P, b'{"model":"tiny-hostile","prompt":"a\xff\xfeb"}', None),
        _post("utf8-invalid-key", P, b'{"prompt":"a","\xc3\x28":1}', None),
        _post("utf8-overlong", P, b'{"prompt":"\xc0\xaf"}', None),
        _post("utf8-lone-continuation", C, b'{"messages":[{"role":"user","content":"\x80"}]}', None),
        # Python's JSON reader decodes UTF-8-encoded surrogates (surrogatepass): caught as a lone surrogate.
        _post("utf8-encoded-surrogate", P, b'{"prompt":"\xed\xa0\x80"}', "prompt"),
        _post("utf8-invalid-tokenize", T, b'{"prompt":"\xfe"}', None),
        _post("utf8-invalid-detokenize", D, b'{"tokens":[1],"model":"\xff"}', None),
        _post("truncated-json", P, b'{"prompt": "a", "max_tokens":', None),
        _post("json-trailing-garbage", P, b'{"prompt": "a"} x', None),
        _post("json-nan-literal", P, b'{"prompt":"a","max_tokens":2,"temperature":NaN}', "temperature"),
        _post("json-infinity-literal", P, b'{"prompt":"a","max_tokens":2,"top_p":Infinity}', "top_p"),
        _post("json-nan-in-unknown", P, b'{"prompt":"a","max_tokens":2,"whatever":[NaN]}', "whatever.0"),
        _post("json-deep-nesting", P, b'{"prompt":"a","x":' + b"[" * 5000 + b"]" * 5000 + b"}", None),
        _post("body-null", P, b"null", None),
        _post("body-number", C, b"42", None),
        _post("body-array", T, b"[1, 2]", None),
        _post("body-string", D, b'"tokens"', None),
        _post("body-empty", P, b"", None),
        ("content-type-text", "POST", P, good, {"content-type": "text/plain"}, 400, None),
        ("content-type-form", "POST", C, chat(), {"content-type": "application/x-www-form-urlencoded"}, 400, None),
        ("content-type-missing", "POST", T, body(prompt="a"), {}, 400, None),
        ("content-type-xml", "POST", D, body(tokens=[1]), {"content-type": "application/xml"}, 400, None),
    ]


# Integer fields of a completions request: each gets a value beyond 64 bits, a string and a float.
_INT_FIELDS = ["n", "top_k", "seed", "min_tokens", "max_tokens", "logprobs", "priority", "truncate_prompt_tokens",
               "best_of"]


def _type_and_range_cases() -> list[Case]:
    cases: list[Case] = []
    for field in _INT_FIELDS:
        cases.append(_post(f"int-beyond-64-bits-{field}", P, comp(**{field: BIG}), field))
        cases.append(_post(f"int-as-string-{field}", P, comp(**{field: "3"}), field))
        cases.append(_post(f"int-as-float-{field}", P, comp(**{field: 1.5}), field))
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        cases.append(_post(f"float-as-string-{field}", C, chat(**{field: "0.5"}), field))
        cases.append(_post(f"float-as-bool-{field}", C, chat(**{field: True}), field))
        cases.append(_post(f"float-as-list-{field}", C, chat(**{field: [0.5]}), field))
    for field in ("stream", "echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        cases.append(_post(f"bool-as-int-{field}", P, comp(**{field: 1}), field))
    cases += [
        _post("n-negative", P, comp(n=-1), "n"),
        _post("seed-below-int64", P, comp(seed=-(2 ** 63) - 1), "seed"),
        _post("top_k-beyond-int64", P, comp(top_k=2 ** 63), "top_k"),
        _post("min_tokens-beyond-int64", C, chat(min_tokens=2 ** 63, max_tokens=None), "min_tokens"),
        _post("max_tokens-beyond-int64", P, comp(max_tokens=2 ** 63), "max_tokens"),
        _post("max_completion_tokens-big", C, chat(max_completion_tokens=BIG), "max_completion_tokens"),
        _post("top_logprobs-big", C, chat(logprobs=True, top_logprobs=BIG), "top_logprobs"),
        _post("top_logprobs-negative", C, chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        _post("stop_token_ids-big", P, comp(stop_token_ids=[1, BIG]), "stop_token_ids.1"),
        _post("stop_token_ids-int64", P, comp(stop_token_ids=[2 ** 63 - 1]), "stop_token_ids.0"),
        _post("stop_token_ids-outside-vocab", C, chat(stop_token_ids=[0, 1 << 20]), "stop_token_ids.1"),
        _post("stop_token_ids-string", P, comp(stop_token_ids=["1"]), "stop_token_ids.0"),
        _post("stop-list-of-ints", P, comp(stop=[1, 2]), "stop"),
        _post("stop-dict", C, chat(stop={"a": 1}), "stop"),
        _post("prompt-token-beyond-64-bits", P, comp(prompt=[1, BIG]), "prompt.1"),
        _post("prompt-nested-token-beyond-64-bits", P, comp(prompt=[[1], [2, BIG]]), "prompt.1.1"),
        _post("prompt-bools", P, comp(prompt=[True, False]), "prompt"),
        _post("prompt-floats", P, comp(prompt=[1.5, 2.0]), "prompt"),
        _post("prompt-mixed", P, comp(prompt=["a", 1]), "prompt"),
        _post("prompt-dict", P, comp(prompt={"a": 1}), "prompt"),
        _post("prompt-empty-inner", P, comp(prompt=[[1], []]), "prompt"),
        _post("temperature-inf-overflow", P, b'{"prompt":"a","temperature":1e999}', "temperature"),
        _post("messages-not-list", C, chat(messages={"role": "user"}), "messages"),
        _post("message-content-number", C, chat(messages=[{"role": "user", "content": 1}]), "messages.0.content"),
        _post("message-tool-calls-not-list", C, chat(messages=[{"role": "assistant", "tool_calls": "x"}]),
              "messages.0.tool_calls"),
        _post("tools-not-list", C, chat(tools={"type": "function"}), "tools"),
        _post("tool-type-wrong", C, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type"),
        _post("tool-choice-number", C, chat(tools=[TOOL], tool_choice=3), "tool_choice"),
        _post("response-format-string", C, chat(response_format="json"), "response_format"),
        _post("stream-options-bad", C, chat(stream=True, stream_options={"include_usage": "yes"}),
              "stream_options.include_usage"),
        _post("template-kwargs-list", C, chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
        _post("logit-bias-value", P, comp(logit_bias={"1": "x"}), "logit_bias.1"),
        _post("tokenize-prompt-number", T, body(prompt=5), "prompt"),
        _post("tokenize-nothing", T, body(model=MODEL), "prompt"),
        _post("tokenize-bad-role", T, body(messages=[{"role": "x", "content": "a"}]), "messages.0.role"),
        _post("detokenize-big", D, body(tokens=[BIG]), "tokens.0"),
        _post("detokenize-int64", D, body(tokens=[2 ** 63]), "tokens"),
        _post("detokenize-negative", D, body(tokens=[5, -1]), "tokens.1"),
        _post("detokenize-bool", D, body(tokens=[True]), "tokens.0"),
        _post("detokenize-string", D, body(tokens="12"), "tokens"),
        _post("detokenize-missing", D, body(model=MODEL), "tokens"),
    ]
    return cases


def _arithmetic_cases() -> list[Case]:
    """Values valid alone whose derived values overflow: the per-sample seeds `seed + i`."""
    return [
        _post("seed-max-n2", P, comp(seed=2 ** 64 - 1, n=2), "seed"),
        _post("seed-max-n2-stream", P, comp(seed=2 ** 64 - 1, n=2, stream=True), "seed"),
        _post("seed-near-max-n4", C, chat(seed=2 ** 64 - 3, n=4), "seed"),
        _post("seed-max-n3-prompt-list", P, comp(seed=2 ** 64 - 2, n=3, prompt=["a", "b"]), "seed"),
    ]


def _schema_cases() -> list[Case]:
    def tool(parameters):
        return [TOOL, {"type": "function", "function": {"name": "g", "parameters": parameters}}]
    bad = [("type-unknown", {"type": "nope"}), ("properties-list", {"type": "object", "properties": []}),
           ("required-string", {"required": "a"}), ("minlength-negative", {"minLength": -1}),
           ("enum-empty-not-list", {"enum": 3}), ("draft7-type-number", {"$schema":
                                                                         "http://json-schema.org/draft-07/schema#",
                                                                         "type": 5})]
    cases = [_post(f"tool-schema-{name}", C, chat(tools=tool(schema)), "tools.1.function.parameters")
             for name, schema in bad]
    cases.append(_post("tool-schema-tokenize", T, body(messages=USER, tools=tool({"type": "nope"})),
                       "tools.1.function.parameters"))
    cases.append(_post("response-format-schema", C, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"properties": 7}}}), "response_format.json_schema.schema"))
    return cases


def _limit_cases() -> list[Case]:
    long_prompt = list(range(1, 120))
    return [
        _post("n-above-max", P, comp(n=MAX_N + 1), "n"),
        _post("n-huge", C, chat(n=20000), "n"),
        _post("n-huge-stream", P, comp(n=20000, stream=True), "n"),
        _post("prompts-above-max", P, comp(prompt=["a"] * (MAX_PROMPTS + 1)), "prompt"),
        _post("prompts-200", P, comp(prompt=["a"] * 200), "prompt"),
        _post("token-prompts-above-max", P, comp(prompt=[[1, 2]] * (MAX_PROMPTS + 1)), "prompt"),
        _post("sequences-above-queue", P, comp(n=MAX_N, prompt=["a"] * 3), "n"),
        _post("tokens-above-budget", P, comp(n=MAX_N, max_tokens=250), "max_tokens"),
        _post("tokens-above-budget-list", P, comp(n=2, prompt=[long_prompt] * 4, max_tokens=20), "max_tokens"),
        _post("tokens-above-budget-chat", C, chat(n=MAX_N, max_tokens=None), "max_tokens"),  # n x the context
        _post("tokens-above-budget-chat-stream", C, chat(n=MAX_N, max_tokens=None, stream=True), "max_tokens"),
        _post("prompt-fills-context", P, comp(prompt=list(range(1, MAX_MODEL_LEN + 1))), "prompt"),
        _post("prompt-plus-max-tokens", C, chat(max_tokens=MAX_MODEL_LEN), "max_tokens"),
        _post("body-too-large", P, comp(prompt="x" * MAX_BYTES), None, 413),
        _post("tokenize-too-large", T, body(prompt="y" * MAX_BYTES), None, 413),
    ]


def _route_and_auth_cases() -> list[Case]:
    cases: list[Case] = []
    for method, path in [("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/debug/integrity"),
                         ("GET", "/tokenizer_info"), ("POST", T), ("POST", D), ("POST", C), ("POST", R),
                         ("GET", "/v1/nothing")]:
        raw = body(prompt="a", tokens=[1], messages=USER) if method == "POST" else None
        hdr = JSON if method == "POST" else {}
        slug = path.strip("/").replace("/", "-")
        cases.append((f"no-key-{slug}", method, path, raw, {**hdr, "Authorization": ""}, 401, None))
        cases.append((f"wrong-key-{slug}", method, path, raw, {**hdr, "Authorization": "Bearer sk-wrong"}, 401, None))
    cases += [
        ("key-not-bearer", "GET", "/v1/models", None, {"Authorization": KEY}, 401, None),
        ("key-lowercase-scheme", "GET", "/version", None, {"Authorization": f"bearer {KEY}"}, 401, None),
        ("key-with-suffix", "GET", "/metrics", None, {"Authorization": f"Bearer {KEY}x"}, 401, None),
        ("key-latin1-bytes", "GET", "/v1/models", None, {"Authorization": b"Bearer sk-\xff\xfe"}, 401, None),
        ("unknown-route-get", "GET", "/v1/engines", None, {}, 404, None),
        ("unknown-route-post", "POST", "/v1/embeddings", comp(), JSON, 404, None),
        ("unknown-route-deep", "GET", "/v1/models/x/y/z", None, {}, 404, None),
        ("unknown-route-traversal", "GET", "/../../etc/passwd", None, {}, 404, None),
        ("get-completions", "GET", P, None, {}, 405, None),
        ("put-chat", "PUT", C, chat(), JSON, 405, None),
        ("delete-models", "DELETE", "/v1/models", None, {}, 405, None),
        ("post-models", "POST", "/v1/models", body(), JSON, 405, None),
        ("post-version", "POST", "/version", body(), JSON, 405, None),
        ("post-metrics", "POST", "/metrics", body(), JSON, 405, None),
        ("post-health", "POST", "/health", body(), JSON, 405, None),
        ("get-tokenize", "GET", T, None, {}, 405, None),
        ("patch-detokenize", "PATCH", D, body(tokens=[1]), JSON, 405, None),
        ("post-integrity", "POST", "/debug/integrity", body(), JSON, 405, None),
        ("unknown-model", "POST", P, comp(model="gpt-99"), JSON, 404, "model"),
    ]
    return cases


def _responses_cases() -> list[Case]:
    """/v1/responses: the same walk of the body and the same limits, its own field names in `param`."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    ftool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    return [
        _post("resp-lone-input", R, resp(input=LONE), "input"),
        _post("resp-lone-instructions", R, resp(instructions=LONE), "instructions"),
        _post("resp-lone-part-text", R, resp(input=[{"role": "user", "content": [
            {"type": "input_text", "text": LONE}]}]), "input.0.content.0.text"),
        _post("resp-lone-call-arguments", R, resp(input=[{**call, "arguments": LONE}]), "input.0.arguments"),
        _post("resp-lone-call-output", R, resp(input=[call, {"type": "function_call_output", "call_id": "c1",
                                                             "output": LONE}]), "input.1.output"),
        _post("resp-lone-tool-name", R, resp(tools=[{**ftool, "name": LONE}]), "tools.0.name"),
        _post("resp-lone-metadata-value", R, resp(metadata={"k": LONE}), "metadata.k"),
        _post("resp-lone-user", R, resp(user=LONE), "user"),
        _post("resp-nan-temperature", R, b'{"input":"a","max_output_tokens":2,"temperature":NaN}', "temperature"),
        _post("resp-seed-beyond-64-bits", R, resp(seed=BIG), "seed"),
        _post("resp-max-output-tokens-big", R, resp(max_output_tokens=BIG), "max_output_tokens"),
        _post("resp-max-output-tokens-string", R, resp(max_output_tokens="2"), "max_output_tokens"),
        _post("resp-input-number", R, resp(input=5), "input"),
        _post("resp-item-type-unknown", R, resp(input=[{"type": "computer_call_output", "call_id": "c"}]),
              "input.0"),
        _post("resp-tool-schema", R, resp(tools=[{**ftool, "parameters": {"type": "nope"}}]), "tools.0.parameters"),
        _post("resp-text-format-schema", R, resp(text={"format": {"type": "json_schema", "name": "r",
                                                                  "schema": {"properties": 7}}}),
              "text.format.schema"),
        _post("resp-unknown-field", R, resp(stop=["x"]), "stop"),
        _post("resp-store", R, resp(store=True), "store"),
        _post("resp-previous-response", R, resp(previous_response_id="resp_1"), "previous_response_id"),
        _post("resp-prompt-fills-context", R, resp(input="a " * MAX_MODEL_LEN), "input"),
        _post("resp-tokens-beyond-context", R, resp(max_output_tokens=MAX_MODEL_LEN), "max_output_tokens"),
        _post("resp-too-large", R, resp(input="x" * MAX_BYTES), None, 413),
        ("resp-get", "GET", R, None, {}, 405, None),
        ("resp-unknown-model", "POST", R, resp(model="gpt-99"), JSON, 404, "model"),
        ("resp-no-key", "POST", R, resp(), {**JSON, "Authorization": ""}, 401, None),
    ]


def hostile_cases() -> list[Case]:
    return (_surrogate_cases() + _encoding_cases() + _type_and_range_cases() + _arithmetic_cases()
            + _schema_cases() + _limit_cases() + _route_and_auth_cases() + _responses_cases())


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("k31-tiny")


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, *SERVER_ARGS, api_key=KEY) as srv:
        yield srv


def all_free(hc: httpx.Client) -> dict | None:
    rep = hc.get("/debug/integrity").json()
    ok = rep["ok"] and rep["free_pages"] == rep["total_pages"] and rep["free_slots"] == rep["total_slots"]
    return rep if ok else None


def assert_serving_and_free(hc: httpx.Client) -> None:
    r = hc.post(P, content=comp(max_tokens=3, ignore_eos=True), headers=JSON)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = hc.post(C, content=chat(max_tokens=2, n=2, seed=2 ** 64 - 2), headers=JSON)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    rep = wait_until(lambda: all_free(hc), 5, 0.1)
    assert rep, f"pools not intact / not all free: {hc.get('/debug/integrity').text}"
    assert rep["total_pages"] > 0 and rep["total_slots"] > 0


def _problem(case: Case, r: httpx.Response) -> str | None:
    """Why `r` is not the expected OpenAI-shaped error for `case`, or None."""
    name, _method, _path, _raw, _headers, status, param = case
    try:
        payload = r.json()
    except ValueError:
        return f"{name}: {r.status_code} with a body that is not JSON: {r.text[:200]!r}"
    err = payload.get("error") if isinstance(payload, dict) else None
    if r.status_code != status:
        return f"{name}: status {r.status_code} != {status}: {r.text[:300]}"
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"{name}: not an OpenAI error body: {payload}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
            and err["code"] == status):
        return f"{name}: bad error fields: {err}"
    if err["param"] != param:
        return f"{name}: param {err['param']!r} != {param!r}: {err['message']}"
    return None


# ------------------------------------------------------------------------------------------------------ tests
def test_case_table_is_broad():
    cases = hostile_cases()
    names = [c[0] for c in cases]
    assert len(cases) >= 150 and len(set(names)) == len(names)
    paths = {c[2] for c in cases}
    for path in (P, C, T, D, R, "/v1/models", "/version", "/metrics", "/debug/integrity", "/health"):
        assert path in paths, path


def test_hostile_requests_get_openai_errors(server):
    failures = []
    with httpx.Client(base_url=server.url, timeout=15) as hc:
        for case in hostile_cases():
            name, method, path, raw, headers, _status, _param = case
            sent = {**AUTH, **headers}
            sent = {k: v for k, v in sent.items() if v}
            try:
                r = hc.request(method, path, content=raw, headers=sent)
            except httpx.HTTPError as exc:
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            problem = _problem(case, r)
            if problem:
                failures.append(problem)
        assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
        hc.headers.update(AUTH)
        assert_serving_and_free(hc)


def test_queue_counts_sequences_and_answers_503(server):
    """Two held streams (n=4 of one prompt; n=2 of two prompts) fill the 8-sequence queue: one more sequence gets
    503 + Retry-After; after the streams close, requests are admitted again and every page and slot is free."""
    held_body = comp(n=MAX_N, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as hc:
        with hc.stream("POST", P, content=held_body, headers=JSON) as first, \
                hc.stream("POST", P, content=comp(n=2, prompt=["a", "b"], max_tokens=200, ignore_eos=True,
                                                  stream=True), headers=JSON) as second:
            for held in (first, second):
                assert held.status_code == 200, held.read()
            # Keep the event iterators referenced: closing one closes its connection, which aborts the stream.
            events = [iter_sse(first), iter_sse(second)]
            assert all(next(e)["choices"] for e in events)
            for raw, path in [(comp(), P), (chat(), C)]:
                r = hc.post(path, content=raw, headers=JSON)
                assert r.status_code == 503, r.text
                assert r.headers.get("retry-after") == "1"
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == 503
                assert "queue" in err["message"] and "sequences" in err["message"]
            assert hc.get("/health").status_code == 200  # full, not unhealthy
            assert hc.post(T, content=body(prompt="a"), headers=JSON).status_code == 200  # no engine sequences

        def admitted():
            r = hc.post(P, content=comp(n=MAX_N, prompt=["a", "b"]), headers=JSON)
            return r if r.status_code == 200 else None
        r = wait_until(admitted, 10, 0.1)
        assert r, "still refused after the held streams were closed"
        assert len(r.json()["choices"]) == 2 * MAX_N
        assert_serving_and_free(hc)


def test_offline_generate_rejects_malformed_input(checkpoint):
    llm = LLM(str(checkpoint), kv_cache_memory="64MiB", max_model_len=64)
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = llm.generate("Hello", good, use_tqdm=False)[0].outputs[0].token_ids
    overflowing = SamplingParams(n=2, seed=1)
    overflowing.seed = 2 ** 64 - 1  # changed after construction: generate re-validates
    bad = [({"a": 1}, good, "prompt"), ([["12", "13"]], good, "prompt"), ([[1.7, 2.2]], good, "prompt"),
           ([[True, False]], good, "prompt"), ([1.7, 2.2], good, "prompt"), ([True, 3], good, "prompt"),
           (["ok", LONE], good, "prompt"), ([[1, -1]], good, "prompt"), ([[1, BIG]], good, "prompt"),
           (["a", "b"], [good], "sampling_params"), (["a"], ["not params"], "sampling_params"),
           ("Hello", overflowing, "seed")]
    for prompts, params, field in bad:
        with pytest.raises(InvalidRequestError) as err:
            llm.generate(prompts, params, use_tqdm=False)
        assert err.value.field == field, (prompts, err.value)
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(n=3, seed=2 ** 64 - 2)
    assert err.value.field == "seed"
    assert llm.generate("Hello", good, use_tqdm=False)[0].outputs[0].token_ids == want
    out = llm.generate(["Hello", [1, 2, 3]], SamplingParams(n=2, seed=2 ** 64 - 2, max_tokens=2), use_tqdm=False)
    assert [len(o.outputs) for o in out] == [2, 2]
    llm.engine.check_integrity()
