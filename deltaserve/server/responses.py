"""POST /v1/responses: OpenAI's Responses API on the chat path (docs/serving.md §10, "The Responses API").

The request (responses_protocol.py) is rendered as the equivalent chat, generated with the chat path's admission,
limits and engine stream, and its output ids are split by the same output parser into reasoning, content and tool
calls. `OutputItems` turns the parser's deltas into Responses output items — a `reasoning` item, a `message` item
with one `output_text` part, a `function_call` item per call, in the order the model wrote them — and into the typed
stream events that build those items. A non-streamed response is built by the same `OutputItems` from the same
deltas, so a stream's final response equals the non-streamed one.

Stream: `response.created`, `response.in_progress`, then per item `response.output_item.added`, its content
(`response.content_part.added`, `response.reasoning_text.delta` / `response.output_text.delta` ...,
`response.reasoning_text.done` / `response.output_text.done`, `response.content_part.done`; for a call
`response.function_call_arguments.delta` and `.done`), `response.output_item.done`; last `response.completed`, or
`response.incomplete` when max_output_tokens (or the context) cut the output. Every event has a `sequence_number`
counting from 0. A failure after the stream started ends it with an `error` event.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import ChatError
from ..engine.sampling_params import InvalidRequestError, SamplingParams
from ..errors import RequestFailedError
from .engine_client import EngineDeadError
from .handlers import ServerState, collect, stream_error, tracked, fairness_key
from .output_base import Delta
from .parsers import parser_for
from .protocol import response_format_constraint, sse_data
from .responses_protocol import ResponsesRequest


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Builds a response's output items from the output parser's deltas, and the stream events that build them.

    Contract: `feed(delta)` and `finish(cut)` return the events (dicts without `sequence_number`) that the delta or
    the end of generation completes; `items` then holds every output item as it is in the final response. An item
    still open when the output was cut (`cut`: max_output_tokens or the context ran out) ends with status
    `incomplete`; every other item is `completed`. Empty reasoning or text opens no item.
    """

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item whose text is still arriving
        self._text: list[str] = []

    def feed(self, delta: Delta) -> list[dict]:
        events: list[dict] = []
        if delta.reasoning_content:
            events += self._append("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._append("message", delta.content)
        for call in delta.tool_calls:
            events += self._close("completed")
            events += self._function_call(call.id, call.name, call.arguments)
        return events

    def finish(self, cut: bool) -> list[dict]:
        return self._close("incomplete" if cut else "completed")

    # -- items ---------------------------------------------------------------------------------------------------
    def _append(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._start(kind)
        self._text.append(text)
        item = self._open
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": kind_event, "item_id": item["id"], "output_index": len(self.items), "content_index": 0,
                 "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def _start(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"id": _item_id("msg"), "type": "message", "role": "assistant", "content": [],
                    "status": "in_progress"}
        self._open, self._text = item, []
        index = len(self.items)
        return [{"type": "response.output_item.added", "output_index": index, "item": dict(item, content=[])},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": self._part(kind, "")}]

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        kind, text, index = item["type"], "".join(self._text), len(self.items)
        part = self._part(kind, text)
        item.update(content=[part], status=status)
        self.items.append(item)
        done = {"type": "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done",
                "item_id": item["id"], "output_index": index, "content_index": 0, "text": text}
        if kind == "message":
            done["logprobs"] = []
        return [done,
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def _function_call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        """A call arrives whole from the parser (docs/chat.md §3.5): its item opens, gets its arguments in one delta
        and closes."""
        item = {"id": _item_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        index = len(self.items)
        done = dict(item, arguments=arguments, status="completed")
        self.items.append(done)
        return [{"type": "response.output_item.added", "output_index": index, "item": item},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                 "delta": arguments},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                 "name": name, "arguments": arguments},
                {"type": "response.output_item.done", "output_index": index, "item": done}]


def _usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


def _tool_choice(req: ResponsesRequest) -> str | dict:
    """The effective tool_choice, as the chat path resolves an unset one."""
    if req.tool_choice is None:
        return "auto" if req.tools else "none"
    return req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()


def _response(req: ResponsesRequest, params: SamplingParams, rid: str, model: str, created: int, status: str,
              output: list[dict], usage: dict | None) -> dict:
    """The `response` object: the request's settings as applied, and the output so far."""
    text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": False, "temperature": params.temperature, "text": {"format": text_format},
            "tool_choice": _tool_choice(req), "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": params.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}


def _event(event: dict) -> str:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\n" + sse_data(json.dumps(event, ensure_ascii=False, separators=(",", ":")))


def _status(completion) -> str:
    """`incomplete` when the output was cut by max_output_tokens or the end of the context, else `completed`."""
    return "incomplete" if completion.finish_reason == "length" else "completed"


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request, rid: str):
    chat = req.chat_prompt()
    try:
        ids, thinking, images = state.render(chat, await state.fetch_images(chat.messages))
    except ChatError as exc:  # the conversation cannot be rendered: the fault is in `input`
        raise InvalidRequestError("input", str(exc)) from None
    state.check_prompt(ids, "input")
    params = req.to_sampling_params()
    params.structured_outputs = state.chat_constraint(
        chat, *response_format_constraint(chat.response_format, "text.format"), req.parallel_tool_calls is not False,
        thinking)
    state.check_room(ids, params, "max_output_tokens")
    state.limits.check_tokens([len(ids)], 1, params.max_tokens, state.engine.max_model_len, "max_output_tokens")
    model = state.served_names[0] if req.model is None else req.model
    created = int(time.time())
    stream = tracked(state, rid, None, ids, params, None, fairness_key(req.user, rid), images)
    parser = parser_for(state.config, state.tokenizer).stream(thinking)
    items = OutputItems()

    def usage(final) -> dict:
        return _usage(len(ids), len(final.outputs[0].token_ids), final.num_cached_tokens, parser.reasoning_tokens)

    if not req.stream:
        final = await collect(stream, raw)
        completion = final.outputs[0]
        for delta in parser.feed(completion.token_ids) + parser.finish():
            items.feed(delta)
        status = _status(completion)
        items.finish(status == "incomplete")
        return JSONResponse(_response(req, params, rid, model, created, status, items.items, usage(final)))

    async def events():
        sequence = 0

        def emit(event: dict) -> str:
            nonlocal sequence
            event["sequence_number"] = sequence
            sequence += 1
            return _event(event)

        try:
            started = _response(req, params, rid, model, created, "in_progress", [], None)
            yield emit({"type": "response.created", "response": started})
            yield emit({"type": "response.in_progress", "response": started})
            seen = 0
            async for final in stream:
                completion = final.outputs[0]
                deltas = parser.feed(completion.token_ids[seen:])
                seen = len(completion.token_ids)
                if completion.finished:
                    deltas += parser.finish()
                for delta in deltas:
                    for event in items.feed(delta):
                        yield emit(event)
            status = _status(final.outputs[0])
            for event in items.finish(status == "incomplete"):
                yield emit(event)
            done = _response(req, params, rid, model, created, status, items.items, usage(final))
            yield emit({"type": f"response.{status}", "response": done})
        except (InvalidRequestError, EngineDeadError, RequestFailedError) as exc:
            error = stream_error(exc)["error"]
            yield emit({"type": "error", "code": error["type"], "message": error["message"], "param": error["param"]})
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")
