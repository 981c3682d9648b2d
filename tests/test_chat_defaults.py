"""A chat request that says nothing about thinking thinks only where the model's format has a reasoning channel
(chat.thinks_by_default): K3 always; a template family when its template opens one. An instruct model's answer
then arrives as `content`, not as `reasoning_content` with an empty content."""

from __future__ import annotations

import json

import openai

from deltaserve.chat import thinks_by_default
from deltaserve.models.loader import load_config
from deltaserve.tokenizer import TiktokenTokenizer, load_tokenizer, read_tiktoken_model
from server_utils import run_server


def test_thinks_by_default_follows_the_format(make_checkpoint):
    for preset, thinks in (("k31-tiny", True), ("kimi-linear-tiny", False), ("deepseek-v32-tiny", False)):
        path = make_checkpoint(preset)
        assert thinks_by_default(load_tokenizer(path), load_config(path)) is thinks, preset
    # a K2-Thinking style template (it writes <think>) thinks by default
    path = make_checkpoint("kimi-linear-tiny")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = load_tokenizer(path).chat_template + "{%- if add_generation_prompt -%}<think>{%- endif -%}"
    assert thinks_by_default(TiktokenTokenizer(read_tiktoken_model(path / "tiktoken.model"), config), load_config(path))


def test_instruct_chat_answers_in_content(make_checkpoint):
    with run_server(make_checkpoint("kimi-linear-tiny"), "--served-model-name", "k2", "--kv-cache-memory",
                    "64MiB") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        out = client.chat.completions.create(model="k2", messages=[{"role": "user", "content": "Hello"}],
                                             max_tokens=8, temperature=0)
        message = out.choices[0].message
        assert message.content and getattr(message, "reasoning_content", None) is None, message
        thought = client.chat.completions.create(model="k2", messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=8, temperature=0, reasoning_effort="high")
        assert getattr(thought.choices[0].message, "reasoning_content", None), thought.choices[0].message
