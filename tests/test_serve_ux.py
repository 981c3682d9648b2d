"""What a new user sees: `--help` with defaults, `--dtype auto`, the start-up banner, one access-log line per request,
and /metrics under vLLM's names with --metrics-compat vllm (docs/serving.md §11, §13).

Two real servers, module-scoped: `bf16` (a bfloat16 k31-tiny checkpoint under the default --dtype auto, request
logging on, --metrics-compat vllm) and `fp32` (a float32 checkpoint, --disable-log-requests, no compat names). The
log they write is the server's captured stdout and stderr (server_utils.run_server).
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cache.state_slots import StateSlots
from deltaserve.cli import main
from deltaserve.engine.config import EngineArgs, resolve_dtype
from deltaserve.errors import ConfigError
from deltaserve.models.loader import load_config
from deltaserve.server.metrics import VLLM_SERIES, Metrics

from server_utils import integrity, run_server, wait_until

MODEL = "tiny"
KV_MEMORY = 32 << 20
BLOCK = 16
COMMON = ("--served-model-name", MODEL, "--kv-cache-memory", "32MiB", "--block-size", str(BLOCK),
          "--max-num-seqs", "8")
ACCESS = re.compile(r"INFO deltaserve\.server\.access_log: (\S+) (\S+) (\S+) (\d+) prompt_tokens=(\S+) "
                    r"completion_tokens=(\S+) cached_tokens=(\S+) ttft=(\S+) e2e=(\S+)s finish=(\S+)$", re.M)


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def bf16_checkpoint(make_checkpoint):
    return make_checkpoint("k31-tiny")


@pytest.fixture(scope="module")
def fp32_checkpoint(make_checkpoint):
    return make_checkpoint("k31-tiny", dtype="float32")


@pytest.fixture(scope="module")
def bf16(bf16_checkpoint):
    with run_server(bf16_checkpoint, *COMMON, "--metrics-compat", "vllm") as srv:
        yield srv


@pytest.fixture(scope="module")
def fp32(fp32_checkpoint):
    with run_server(fp32_checkpoint, *COMMON, "--disable-log-requests") as srv:
        yield srv


def log_text(server) -> str:
    return server.log_path.read_text(errors="replace")


def access_lines(server) -> list[dict]:
    keys = ("id", "method", "path", "status", "prompt", "completion", "cached", "ttft", "e2e", "finish")
    return [dict(zip(keys, m.groups())) for m in ACCESS.finditer(log_text(server))]


def new_access_lines(server, before: int, count: int) -> list[dict]:
    """The access lines after the first `before`, once there are `count` of them (a line is written as its answer
    finishes, which may be just after the client has it)."""
    lines = wait_until(lambda: access_lines(server)[before:] if len(access_lines(server)) >= before + count else [],
                       10)
    assert len(lines) == count, (lines, log_text(server)[-3000:])
    return lines


def scrape(server) -> dict[str, float]:
    """/metrics as {series with labels: value}."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


# --------------------------------------------------------------------------------------------------- --help
def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def _option_blocks(text: str) -> dict[str, str]:
    """--help text -> {first option string: its whole entry, lines joined}."""
    blocks, name = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-{1,2}[\w-]+)", line)
        if m:
            name = m.group(1)
            blocks[name] = line
        elif name is not None and line.startswith("    "):
            blocks[name] += " " + line.strip()
        else:
            name = None
    return {k: re.sub(r"\s+", " ", v) for k, v in blocks.items()}


def test_serve_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    blocks = _option_blocks(_help(capsys, "serve"))
    assert "(default: 8000)" in blocks["--port"] and "(default: 127.0.0.1)" in blocks["--host"]
    assert "(default: auto)" in blocks["--dtype"] and "(default: 2GiB)" in blocks["--kv-cache-memory"]
    assert "(default: 64)" in blocks["--max-num-seqs"] and "(default: 30.0)" in blocks["--shutdown-timeout"]
    assert "--fault-injection" not in blocks  # hidden flags stay hidden
    takes_value = [k for k, v in blocks.items() if re.match(r"\s*--[\w-]+ [A-Z{]", v)]
    assert len(takes_value) >= 30
    missing = [k for k in takes_value if "default" not in blocks[k]]
    assert not missing, {k: blocks[k] for k in missing}


@pytest.mark.parametrize("argv, flag, default", [
    (("generate",), "--max-tokens", "32"), (("make-model",), "--shard-size-mb", "2048.0"),
    (("bench", "throughput"), "--input-len", "128"), (("bench", "serve"), "--api", "chat"),
    (("bench", "soak"), "--clients", "128")])
def test_other_subcommands_show_defaults(capsys, monkeypatch, argv, flag, default):
    monkeypatch.setenv("COLUMNS", "200")
    assert f"(default: {default})" in _option_blocks(_help(capsys, *argv))[flag]


# --------------------------------------------------------------------------------------------------- --dtype auto
@pytest.mark.parametrize("requested, stored, served", [
    ("auto", "bfloat16", "bfloat16"), ("auto", "float32", "float32"), ("auto", "float16", "bfloat16"),
    ("auto", "torch.bfloat16", "bfloat16"), ("auto", None, "float32"), ("float32", "bfloat16", "float32"),
    ("bfloat16", "float32", "bfloat16"), ("bf16", None, "bfloat16")])
def test_resolve_dtype(requested, stored, served):
    got = resolve_dtype(requested, stored)
    assert got.name == served
    assert (stored in got.reason) if requested == "auto" and stored else got.reason


def test_unservable_dtypes_are_config_errors():
    with pytest.raises(ConfigError, match="dtype"):
        EngineArgs(dtype="float16")
    with pytest.raises(ConfigError, match="float64"):
        resolve_dtype("auto", "float64")
    assert EngineArgs().dtype == "auto"


def _with_torch_dtype(src, dst, value):
    """A copy of checkpoint `src` whose config.json names `value` as torch_dtype (None: names none)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for d in (raw, raw.get("text_config", {})):
        d.pop("torch_dtype", None)
        d.pop("dtype", None)
        if value is not None:
            d["torch_dtype"] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("stored, served", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                            ("float16", torch.bfloat16), (None, torch.float32)])
def test_offline_llm_serves_the_checkpoint_dtype(bf16_checkpoint, tmp_path, stored, served):
    path = _with_torch_dtype(bf16_checkpoint, tmp_path / "ckpt", stored)
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK, max_num_seqs=2)
    assert llm.engine.dtype == str(served).removeprefix("torch.")
    assert llm.engine.model.embed_tokens.weight.dtype == served
    assert llm.engine.pages.dtype == served  # the latent pages follow the model dtype
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_explicit_dtype_overrides_the_checkpoint(bf16_checkpoint):
    llm = LLM(str(bf16_checkpoint), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK, max_num_seqs=2)
    assert llm.engine.dtype == "float32" and llm.engine.model.embed_tokens.weight.dtype == torch.float32


# --------------------------------------------------------------------------------------------------- banner
def _banner(server) -> dict[str, str]:
    text = log_text(server)
    m = re.search(r"INFO deltaserve\.server\.serve: (deltaserve \S+ serves .*)\n((?:  .*\n)+)", text)
    assert m, text[-3000:]
    fields = {"head": m.group(1)}
    for line in m.group(2).splitlines():
        key, value = line.strip().split(None, 1)
        fields[key] = value
    return fields


def test_banner_bf16(bf16, bf16_checkpoint):
    banner = _banner(bf16)
    assert banner["head"].endswith(f"serves '{MODEL}' on {bf16.url}")
    config = load_config(bf16_checkpoint)
    assert banner["model"].startswith(f"{bf16_checkpoint}: kimi_k3 ({config.architectures[0]}), "
                                      f"{config.num_layers} layers: ")
    assert banner["dtype"] == "bfloat16 (auto: the checkpoint's torch_dtype is bfloat16)"
    version = httpx.get(bf16.url + "/version", timeout=30).json()
    assert banner["backend"].startswith(f"{version['backend']}, {version['ops']} ops ({version['reason']}): ")
    assert banner["weights"].split(";")[1:] == [" quantization: none", " KV cache in bfloat16"]
    # the bytes by storage format, the largest first: the bf16 weights, then the fp32 parameters (A_log, dt_bias)
    assert re.fullmatch(r"[\d.]+ \w+ \(bfloat16 [\d.]+ \w+, float32 [\d.]+ \w+\)", banner["weights"].split(";")[0])
    rep = integrity(bf16)
    slot = StateSlots.bytes_per_slot(config)
    # docs/serving.md §4.5: checkpoints default to min(4 per sequence, 20% of the budget, what the slots leave)
    checkpoints = min(4 * 8, int(0.2 * KV_MEMORY) // slot, (KV_MEMORY - 8 * slot) // slot)
    cache = banner["cache"]
    assert cache.startswith("32.0 MiB = ")
    assert f"{rep['total_pages']} pages of {BLOCK} tokens" in cache
    assert f"{rep['total_pages'] * BLOCK} tokens)" in cache
    assert f"{rep['total_slots']} KDA state slots" in cache
    assert f"{checkpoints} prefix-cache checkpoints" in cache
    max_len = httpx.get(bf16.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    assert banner["context"] == f"{max_len} tokens at most; 8 sequences and 2048 tokens per step"


def test_banner_fp32_and_progress_lines(fp32):
    assert _banner(fp32)["dtype"] == "float32 (auto: the checkpoint's torch_dtype is float32)"
    text = log_text(fp32)
    order = [text.index(s) for s in ("starting: model", "starting the engine-core process", "loading the weights of",
                                     "loaded ", "cache memory:", "serves 'tiny'")]
    assert order == sorted(order), text[-3000:]
    assert "Uvicorn running" not in text and "HTTP/1.1" not in text  # uvicorn's own INFO lines are quiet


# --------------------------------------------------------------------------------------------------- access log
def test_one_access_line_per_request(bf16):
    client = openai.OpenAI(base_url=bf16.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = len(access_lines(bf16))
    prompt = list(range(40, 40 + 3 * BLOCK + 5))  # three full pages: the repeat hits the prefix cache
    fixed = {"ignore_eos": True}  # every completion runs to max_tokens: finish "length"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, extra_body=fixed)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, extra_body=fixed)
    stream = client.completions.create(model=MODEL, prompt=["a b c", "d e"], max_tokens=4, n=2, stream=True,
                                       stream_options={"include_usage": True}, extra_body=fixed)
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][0]
    for _ in range(3):
        assert httpx.get(bf16.url + "/health", timeout=30).status_code == 200  # polls are not logged
    bad = httpx.post(bf16.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                     timeout=30)
    unknown = httpx.post(bf16.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert (bad.status_code, unknown.status_code) == (400, 404)

    lines = new_access_lines(bf16, before, 5)
    for line, out in zip(lines, (first, again)):
        assert (line["id"], line["method"], line["path"], line["status"]) == (out.id, "POST", "/v1/completions",
                                                                              "200")
        assert (int(line["prompt"]), int(line["completion"]), int(line["cached"])) == (
            out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.prompt_tokens_details.cached_tokens)
        assert line["finish"] == out.choices[0].finish_reason == "length"
        assert 0 < float(line["ttft"].removesuffix("s")) <= float(line["e2e"])
    assert int(lines[1]["cached"]) == 3 * BLOCK
    streamed = lines[2]
    assert streamed["id"].startswith("cmpl-") and streamed["status"] == "200"
    assert (int(streamed["prompt"]), int(streamed["completion"])) == (usage.prompt_tokens, usage.completion_tokens)
    assert usage.completion_tokens == 2 * 2 * 4 and streamed["finish"] == "length"
    for line, status in zip(lines[3:], ("400", "404")):
        assert (line["id"], line["status"], line["prompt"], line["ttft"], line["finish"]) == (
            "-", status, "-", "-", "-")


def test_chat_access_line_counts_the_rendered_prompt(bf16):
    client = openai.OpenAI(base_url=bf16.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = len(access_lines(bf16))
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                         temperature=0.0)
    (line,) = new_access_lines(bf16, before, 1)
    assert (line["id"], line["path"], int(line["prompt"]), int(line["completion"])) == (
        out.id, "/v1/chat/completions", out.usage.prompt_tokens, out.usage.completion_tokens)


def test_responses_access_line(bf16):
    client = openai.OpenAI(base_url=bf16.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = len(access_lines(bf16))
    out = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0.0)
    (line,) = new_access_lines(bf16, before, 1)
    assert (line["id"], line["path"], line["status"], int(line["prompt"]), int(line["completion"])) == (
        out.id, "/v1/responses", "200", out.usage.input_tokens, out.usage.output_tokens)


def test_disable_log_requests(fp32):
    r = httpx.post(fp32.url + "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 3},
                   timeout=30)
    bad = httpx.post(fp32.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                     timeout=30)
    assert (r.status_code, bad.status_code) == (200, 400)
    assert access_lines(fp32) == [] and "POST /v1/completions" not in log_text(fp32)


# --------------------------------------------------------------------------------------------------- metrics
def _vllm_twin(series: str) -> str:
    """deltaserve:NAME{labels} -> the vllm: series with vLLM's labels (reason summed away)."""
    name, _, labels = series.partition("{")
    pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    if name.startswith("deltaserve:num_requests_waiting"):
        pairs.pop("reason", None)
    pairs.update(model_name=MODEL, engine="0")
    body = ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))
    return "vllm:" + name.removeprefix("deltaserve:") + "{" + body + "}"


def _mapped(series: str) -> bool:
    name = series.partition("{")[0].removeprefix("deltaserve:")
    return any(name == base or name.startswith(base + "_") for base in VLLM_SERIES)


def test_vllm_names_read_the_same_and_move_with_requests(bf16):
    def success(metrics):
        return sum(v for k, v in metrics.items() if k.startswith("vllm:request_success_total{"))

    start = scrape(bf16)
    r = httpx.post(bf16.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "one two three", "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200
    usage = r.json()["usage"]
    now = scrape(bf16)
    key = 'vllm:prompt_tokens_total{engine="0",model_name="tiny"}'
    assert now[key] - start[key] == usage["prompt_tokens"]
    key = 'vllm:generation_tokens_total{engine="0",model_name="tiny"}'
    assert now[key] - start[key] == usage["completion_tokens"]
    assert success(now) - success(start) == 1
    key = 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"}'
    assert now[key] - start[key] == 1
    mapped = [s for s in now if s.startswith("deltaserve:") and _mapped(s) and not s.partition("{")[0].endswith(
        "_created")]
    assert len(mapped) > 40  # gauges, counters and every histogram bucket
    waiting = sum(v for k, v in now.items() if k.startswith("deltaserve:num_requests_waiting"))
    for series in mapped:
        twin = _vllm_twin(series)
        expected = waiting if series.startswith("deltaserve:num_requests_waiting") else now[series]
        assert now[twin] == expected, (series, twin)
    unmapped = {s.partition("{")[0] for s in now if s.startswith("deltaserve:") and not _mapped(s)}
    assert "deltaserve:state_slots_usage_perc" in unmapped
    assert not any(s.startswith(("vllm:state_slots", "vllm:engine_restarts", "vllm:cache_config")) for s in now)


def test_no_vllm_names_without_the_flag(fp32):
    text = httpx.get(fp32.url + "/metrics", timeout=30).text
    assert "deltaserve:num_requests_running" in text and "vllm:" not in text


def test_compat_waiting_sums_the_reasons():
    metrics = Metrics(compat="vllm", model_name="m")
    metrics.observe_engine_stats({"num_waiting_by_reason": {"capacity": 2, "deferred": 3}})
    text = metrics.render()[0].decode()
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0' in text
    assert 'deltaserve:num_requests_waiting{reason="deferred"} 3.0' in text
    with pytest.raises(ValueError, match="compat"):
        Metrics(compat="sglang")


def test_cut_off_requests_are_logged_as_aborts(bf16):
    max_len = httpx.get(bf16.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": max_len - 16, "ignore_eos": True}
    before = len(access_lines(bf16))
    with httpx.stream("POST", bf16.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # one chunk, then the client leaves
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed client that gives up before the answer
        httpx.post(bf16.url + "/v1/completions", json=body, timeout=0.5)
    streamed, waited = new_access_lines(bf16, before, 2)
    assert (streamed["status"], streamed["finish"]) == ("200", "abort")
    assert 0 < int(streamed["completion"]) < max_len - 16
    assert (waited["status"], waited["finish"]) == ("499", "abort")
    assert waited["id"].startswith("cmpl-") and int(waited["prompt"]) == int(streamed["prompt"])
    assert "Traceback" not in log_text(bf16)  # a client leaving is not an error of the server
