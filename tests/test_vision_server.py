"""Images through the server (docs/vision.md) with the real openai client: a tiny K3 checkpoint with a vision tower
answers a chat holding an image the way the offline engine does; the same image again (also fetched from an allowed
host) hits the prefix cache, another image of the same size does not; a matrix of bad image parts is answered with
400s naming them while the server keeps serving, its pools intact and free."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import re
import threading

import httpx
import openai
import pytest
from PIL import Image

from engine_utils import greedy, make_llm
from server_utils import assert_all_free, run_server


def _data_url(colour, size=(90, 70), fmt="PNG") -> str:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


@contextlib.contextmanager
def _image_host(png: bytes):
    """An HTTP server on loopback: /red.png is `png`, /moved.png redirects to it, anything else is 404."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/red.png":
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.end_headers()
                self.wfile.write(png)
            elif self.path == "/moved.png":
                self.send_response(302)
                self.send_header("location", "/red.png")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def _chat(url: str, text: str = "describe it") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.slow
def test_chat_with_images_over_the_api(make_checkpoint):
    path = make_checkpoint("k3-tiny-vision")
    red, blue = _data_url((200, 30, 30)), _data_url((30, 30, 200))
    offline = make_llm(path).chat(_chat(red), greedy(6), use_tqdm=False)[0].outputs[0].text
    png = base64.b64decode(red.split(",", 1)[1])
    with _image_host(png) as host, \
            run_server(path, "--dtype", "float32", "--served-model-name", "m", "--max-images-per-request", "2",
                       "--allowed-media-domains", "127.0.0.1") as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            def ask(url, **kw):
                return client.chat.completions.create(model="m", messages=_chat(url), max_tokens=6, temperature=0,
                                                      extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
            first = ask(red)
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "length"
            # a thinking chat: the answer so far is reasoning, its special tokens spelled out (the offline text
            # skips them)
            said = re.sub(r"<\|reserved_token_\d+\|>", "", (message.reasoning_content or "") + (message.content or ""))
            assert said == offline
            second, other = ask(red), ask(blue)
            fetched = ask(f"{host}/red.png")  # an allowed host: fetched, the same image, a prefix hit
            assert fetched.choices[0].message == first.choices[0].message
            assert fetched.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens
            assert second.choices[0].message.content == first.choices[0].message.content
            assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
            assert other.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens
        bad = [
            ("https://example.com/cat.png", "fetched only from the server's --allowed-media-domains"),
            ("data:image/png;base64,@@@", "not valid base64"),
            ("file:///etc/passwd", "base64 data URL"),
            ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a readable image"),
            (red[:len(red) // 2], "not"),  # a truncated PNG (or truncated base64)
            ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(), "not a readable"),
            ("data:image/gif;base64," + base64.b64encode(b"GIF89a").decode(), "not a readable image"),
            ("", "base64 data URL"),
            (f"{host}/missing.png", "HTTP 404"),
            (f"{host}/moved.png", "HTTP 302"),  # redirects are not followed
            (f"{host.replace('127.0.0.1', 'localhost')}/red.png", "--allowed-media-domains"),
        ]
        for url, needle in bad:
            answer = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                                json={"model": "m", "messages": _chat(url), "max_tokens": 2})
            assert answer.status_code == 400, (url[:40], answer.text)
            assert needle in answer.json()["error"]["message"], (url[:40], answer.text)
        three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": red}}] * 3}]
        answer = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                            json={"model": "m", "messages": three, "max_tokens": 2})
        assert answer.status_code == 400 and "--max-images-per-request" in answer.text
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                        json={"model": "m", "messages": _chat(red), "max_tokens": 6, "temperature": 0,
                              "ignore_eos": True, "return_token_ids": True})
        assert ok.status_code == 200
        assert_all_free(srv)
