"""Images through the engine (docs/vision.md): a tiny K3 checkpoint with a vision tower (`k3-tiny-vision`), prompts
holding `<|kimi_image_placeholder|>`, the offline LLM. Greedy tokens equal a plain forward with the image features on
the pad rows, through chunked prefill split inside the pad run; the same image hits the prefix cache, another image
of the same size never shares its pages; requests the engine cannot take are refused naming why."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from deltaserve.engine.sampling_params import InvalidRequestError
from deltaserve.layers.batch import StepBatch
from deltaserve.vision import IMAGE_PLACEHOLDER
from engine_utils import assert_pools_free, greedy, make_llm


def _png(colour, size=(90, 70)) -> bytes:
    out = io.BytesIO()
    img = Image.new("RGB", size, colour)
    img.putpixel((3, 5), (255 - colour[0], 0, 0))
    img.save(out, format="PNG")
    return out.getvalue()


@torch.no_grad()
def _reference_greedy(core, ids: list[int], rows: list[tuple[int, torch.Tensor]], steps: int) -> list[int]:
    """Greedy tokens by full forwards of the whole sequence, the features put on their rows."""
    model, out = core.model, []
    for _ in range(steps):
        seq = torch.tensor(ids + out)
        batch = StepBatch.single(len(seq))
        batch.input_embeds = (torch.cat([torch.arange(s, s + len(f)) for s, f in rows]), torch.cat([f for _, f in rows]))
        out.append(int(model.compute_logits(model(seq, batch))[-1].argmax()))
    return out


def test_image_prompts_decode_as_the_plain_forward_and_hit_only_their_own_pages(make_checkpoint):
    path = make_checkpoint("k3-tiny-vision")
    llm = make_llm(path, max_num_batched_tokens=20, block_size=16)
    core = llm.engine.core
    text = "def look(x):\n" * 4 + IMAGE_PLACEHOLDER + " and so on"
    red, blue = _png((200, 30, 30)), _png((30, 30, 200))
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [red]}}, greedy(8), use_tqdm=False)[0]
    (start, count, image), = _spans(llm, text, red)
    ids = out.prompt_token_ids
    assert ids[start:start + count] == [core.config.media_placeholder_token_id] * count
    want = _reference_greedy(core, ids, [(start, core.image_features[image.digest])], 8)
    assert out.outputs[0].token_ids == want
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": [red]}}, greedy(8), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want and again.num_cached_tokens > start + count - 16
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": [blue]}}, greedy(8), use_tqdm=False)[0]
    assert other.num_cached_tokens <= start  # the text before the image may hit; no page holding pads does
    (_, _, blue_image), = _spans(llm, text, blue)
    assert other.outputs[0].token_ids == _reference_greedy(core, ids, [(start, core.image_features[blue_image.digest])], 8)
    assert_pools_free(llm.engine)


def _spans(llm, text, data):
    from deltaserve.vision import expand_prompt, preprocess

    image = preprocess(data, llm.engine.core.media)
    return llm.engine.core._image_spans(expand_prompt(text, [image], llm.tokenizer), [image], {})


def test_requests_with_images_the_engine_cannot_take_are_refused(make_checkpoint):
    red = _png((200, 30, 30))
    text = IMAGE_PLACEHOLDER + " hi"
    vision = make_llm(make_checkpoint("k3-tiny-vision"))
    cases = [(make_llm(make_checkpoint("k3-tiny")), {"prompt": text, "multi_modal_data": {"image": [red]}},
              "takes no images"),
             (vision, {"prompt": text + IMAGE_PLACEHOLDER, "multi_modal_data": {"image": [red]}},
              "2 image placeholders"),
             (vision, {"prompt": text, "multi_modal_data": {"image": [b"not an image"]}}, "image 0: the data is not"),
             (vision, {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": [red]}}, "pad runs \\[\\] do not"),
             (vision, {"prompt": text, "multi_modal_data": {"video": [red]}}, "optionally multi_modal_data")]
    for llm, prompt, needle in cases:
        with pytest.raises(InvalidRequestError, match=needle):
            llm.generate(prompt, greedy(2), use_tqdm=False)
    assert_pools_free(vision.engine)


def test_chat_image_parts_render_as_their_runs(make_checkpoint):
    """`LLM.chat` with an image_url data-URL part: the rendered prompt holds the image's run in the part's place
    and decodes as the same ids with the image given to `generate`; bad parts are refused naming why."""
    import base64

    llm = make_llm(make_checkpoint("k3-tiny-vision"))
    red = _png((200, 30, 30))
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(red).decode()}}
    chat = [{"role": "user", "content": [{"type": "text", "text": "what is this? "}, part,
                                         {"type": "text", "text": " tell me"}]}]
    out = llm.chat(chat, greedy(6), use_tqdm=False)[0]
    pad = llm.engine.core.config.media_placeholder_token_id
    assert out.prompt_token_ids.count(pad) == 12  # 90 x 70 pads to 112 x 84: 8 x 6 patches, 2 x 2 merged
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids, "multi_modal_data": {"image": [red]}},
                          greedy(6), use_tqdm=False)[0]
    assert direct.outputs[0].token_ids == out.outputs[0].token_ids
    for url, needle in [("https://example.com/cat.png", "--allowed-media-domains"),
                        ("data:image/png;base64,@@@", "not valid base64"),
                        ("file:///etc/passwd", "base64 data URL"),
                        ("data:image/png;base64," + base64.b64encode(b"nope").decode(), "not a readable image")]:
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(InvalidRequestError, match=needle):
            llm.chat(bad, greedy(2), use_tqdm=False)
    assert_pools_free(llm.engine)
