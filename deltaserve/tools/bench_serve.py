"""`deltaserve bench serve`: a streaming load client for any OpenAI-compatible endpoint (ours or a peer's).

For each point of a --concurrency or --request-rate sweep it runs a seeded workload (bench_workloads) against
`/chat/completions` or `/completions` with `stream: true` and measures per request: time to first token (TTFT),
inter-token latencies (ITL: gaps between streamed chunks that carry text), time per output token
(TPOT = (end-to-end - TTFT) / (output tokens - 1)) and end-to-end latency; per point: request and output-token
throughput over the wall time of the point, and errors (non-200 answers, broken streams, timeouts). Output tokens
come from the final `usage` chunk when the server sends one, else from the number of text chunks.
Concurrency C keeps C conversations in flight; a request rate R starts conversations at Poisson arrivals
(mean R/s, seeded). A conversation's turns run one after another.
JSON: {"bench", "config", "machine", "points": [{"concurrency"|"request_rate", "runs": [...], "summary"}]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from .bench_report import emit, format_table, machine_info, new_figure, percentiles, save_figure, summarize_runs
from .bench_workloads import WORKLOADS, Conversation, chat_messages, completion_prompt, make_workload


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint's /v1 root")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /models)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: none)")
    p.add_argument("--api", choices=["chat", "completions"], default="chat", help="the endpoint driven")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed", help="what the conversations look like")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run of each point")
    p.add_argument("--input-len", type=int, default=128, help="words per user turn")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: words of the system prompt")
    p.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--concurrency", type=int, nargs="+", default=None, help="conversations in flight")
    sweep.add_argument("--request-rate", type=float, nargs="+", default=None, help="conversation starts per s")
    p.add_argument("--runs", type=int, default=1, help="runs of each point (fresh workload seed each run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first run's workload")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject the field)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def _body(args: argparse.Namespace, model: str, conv: Conversation, turn: int, replies: list[str]) -> dict:
    body = {"model": model, "stream": True, "max_tokens": args.output_len, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.api == "chat":
        body["messages"] = chat_messages(conv, turn, replies)
    else:
        body["prompt"] = completion_prompt(conv, turn, replies)
    return body


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
    return text


async def _one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Stream one request; returns its timings, token counts, reply text and error (None when it succeeded)."""
    start = time.perf_counter()
    stamps: list[float] = []
    reply, usage, error = "", None, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    text = _chunk_text(chunk)
                    if text:
                        stamps.append(time.perf_counter())
                        reply += text
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is None and not stamps:
        error = "no text streamed"
    out_tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"start": start, "end": end, "stamps": stamps, "reply": reply, "error": error,
            "output_tokens": out_tokens, "prompt_tokens": usage["prompt_tokens"] if usage else None}


async def _conversation(client, url, args, model, conv, records, gate: asyncio.Semaphore | None) -> None:
    replies: list[str] = []
    for turn in range(len(conv.turns)):
        if gate is None:
            rec = await _one_request(client, url, _body(args, model, conv, turn, replies))
        else:
            async with gate:
                rec = await _one_request(client, url, _body(args, model, conv, turn, replies))
        records.append(rec)
        if rec["error"]:
            return  # later turns would build on a reply that never came
        replies.append(rec["reply"])


async def _run_point(args, model: str, convs: list[Conversation], concurrency: int | None, rate: float | None,
                     seed: int) -> list[dict]:
    url = args.base_url.rstrip("/") + ("/chat/completions" if args.api == "chat" else "/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    records: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        if concurrency is not None:
            gate = asyncio.Semaphore(concurrency)
            tasks = [_conversation(client, url, args, model, c, records, gate) for c in convs]
        else:
            rng = random.Random(seed)

            async def delayed(conv: Conversation, at: float) -> None:
                await asyncio.sleep(at)
                await _conversation(client, url, args, model, conv, records, None)

            at, tasks = 0.0, []
            for conv in convs:
                tasks.append(delayed(conv, at))
                at += rng.expovariate(rate) if rate != float("inf") else 0.0
        await asyncio.gather(*tasks)
    return records


def _metrics(records: list[dict], duration: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttft = [r["stamps"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    tpot = [(r["end"] - r["stamps"][0]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    e2e = [r["end"] - r["start"] for r in ok]
    out = {"duration_s": duration, "completed": len(ok), "errors": len(records) - len(ok),
           "request_throughput": len(ok) / duration,
           "output_throughput": sum(r["output_tokens"] for r in ok) / duration,
           "total_token_throughput": sum(r["output_tokens"] + (r["prompt_tokens"] or 0) for r in ok) / duration,
           "mean_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok) / max(len(ok), 1)}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for k, v in percentiles(values).items():
            out[f"{name}_{k}_s"] = v
    return out


def _model_name(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = httpx.get(args.base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def run_serve(args: argparse.Namespace) -> str:
    model = _model_name(args)
    key, values = (("request_rate", args.request_rate) if args.request_rate else
                   ("concurrency", args.concurrency or [1]))
    points, first_errors = [], []
    for i, value in enumerate(values):
        runs = []
        for r in range(args.runs):
            seed = args.seed + 1000 * r
            convs = make_workload(args.workload, args.num_prompts, args.input_len, seed, args.prefix_len, args.turns)
            start = time.perf_counter()
            records = asyncio.run(_run_point(args, model, convs, value if key == "concurrency" else None,
                                             value if key == "request_rate" else None, seed + i))
            runs.append(_metrics(records, time.perf_counter() - start))
            first_errors += [rec["error"] for rec in records if rec["error"]][:3 - len(first_errors)]
        points.append({key: value, "runs": runs, "summary": summarize_runs(runs)})
    config = {k: getattr(args, k) for k in ("base_url", "api", "workload", "num_prompts", "input_len", "output_len",
                                            "prefix_len", "turns", "runs", "seed", "ignore_eos")}
    config["model"] = model
    payload = {"bench": "serve", "config": config, "machine": machine_info(), "points": points,
               "sample_errors": first_errors}
    cols = ["request_throughput", "output_throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p50_s",
            "itl_p90_s", "itl_p99_s", "errors"]
    rows = [[p[key], *(p["summary"][c]["median"] for c in cols)] for p in points]
    table = ("serve  " + " ".join(f"{k}={v}" for k, v in config.items()) + "\n"
             + format_table([key, "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "ITL p90",
                             "ITL p99", "errors"], rows))
    if first_errors:
        table += "\nfirst errors: " + " | ".join(first_errors)

    def plot(path: str) -> None:
        fig, (ax1, ax2) = new_figure(2)
        xs = [p[key] for p in points]
        ax1.plot(xs, [p["summary"]["output_throughput"]["median"] for p in points], marker="o")
        ax1.set(xlabel=key, ylabel="output tokens/s", title=f"serve: {args.workload}")
        for m in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            ax2.plot(xs, [p["summary"][m]["median"] * 1e3 for p in points], marker="o", label=m[:-2])
        ax2.set(xlabel=key, ylabel="ms", yscale="log", title="latency")
        ax2.legend()
        save_figure(fig, path)

    return emit(args, payload, table, plot)
