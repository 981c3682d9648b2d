"""guidellm, the load generator people point at vLLM, against a real `deltaserve serve` of the embedded default model
with nothing but the model folder as its tokenizer source (no hub): its synthetic prompts are sized with the
folder's `tokenizer.json`, and the server's usage must count them as guidellm meant them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deltaserve import load_tokenizer
from deltaserve.default_model import default_model_path
from server_utils import assert_all_free, run_server

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 32, 8, 6


def test_guidellm_benchmark_runs_on_the_model_folder(tmp_path):
    folder = default_model_path()
    report = tmp_path / "report.json"
    with run_server(folder, "--served-model-name", "deltaserve-default", "--kv-cache-memory", "64MiB") as server:
        cmd = [str(Path(sys.executable).with_name("guidellm")), "run",
               "--backend", f"kind=openai_http,target={server.url},request_format=/v1/completions",
               "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={REQUESTS}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=huggingface_auto,model={folder}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert_all_free(server)
    (bench,) = json.loads(report.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert totals["successful"] >= REQUESTS and totals["errored"] == 0, totals
    tok = load_tokenizer(folder)
    for request in bench["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        # the server's usage (what guidellm records) counts what guidellm's own tokenizer made of the folder
        assert request["input_metrics"]["text_tokens"] == PROMPT_TOKENS == len(tok.encode(body["prompt"],
                                                                                           allow_special=True))
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        assert request["output"]
