"""The `deltaserve bench` subcommands: argument parsers and handlers. Each handler imports its module lazily (the
CLI stays fast) and prints the table it returns; `--json` and `--plot` are handled by bench_report.emit."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib import import_module

from ..engine.config import EngineArgs
from .bench_report import add_output_args


def _handler(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(getattr(import_module(f"deltaserve.tools.{module}"), function)(args))
        return 0

    return run


def _ops(args: argparse.Namespace) -> int:
    from .bench_ops import run_ops_bench

    print(run_ops_bench(args.repeats))
    return 0


def _engine_parser(sub, name: str, help: str, module: str, function: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    EngineArgs.add_cli_args(p)
    add_output_args(p)
    p.set_defaults(func=_handler(module, function))
    return p


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """Register `bench` and its subcommands on the top-level subparsers `sub`."""
    bench = sub.add_parser("bench", help="benchmarks that print a table (and write --json / --plot)")
    bs = bench.add_subparsers(dest="bench", required=True)

    tp = _engine_parser(bs, "throughput", "offline throughput of the engine", "bench", "run_throughput")
    tp.add_argument("--num-prompts", type=int, nargs="+", default=[8], help="one point per value")
    tp.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    tp.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt")
    tp.add_argument("--runs", type=int, default=3, help="timed runs of each point")

    sp = _engine_parser(bs, "shared-prefix", "TTFT and hit rate with prefix caching on vs off", "bench",
                        "run_shared_prefix")
    sp.add_argument("--prefix-len", type=int, default=2000, help="tokens of the shared prefix")
    sp.add_argument("--question-len", type=int, default=200, help="tokens after the prefix")
    sp.add_argument("--num-requests", type=int, default=32, help="requests sharing the prefix")

    lat = _engine_parser(bs, "latency", "one batch end to end, prefill and decode separately", "bench_latency",
                         "run_latency")
    lat.add_argument("--batch-size", type=int, default=1, help="prompts in the batch")
    lat.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    lat.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt")
    lat.add_argument("--runs", type=int, default=3, help="timed runs")

    lc = _engine_parser(bs, "long-context", "prefill, decode per token and cache bytes vs context length",
                        "bench_long_context", "run_long_context")
    lc.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 131072],
                    help="context lengths measured")
    lc.add_argument("--output-len", type=int, default=16, help="decode steps timed at each context")
    lc.add_argument("--runs", type=int, default=1, help="timed runs of each context")

    rl = _engine_parser(bs, "roofline", "machine bandwidth and matmul throughput; decode as a fraction of the "
                                        "bandwidth ceiling", "bench_roofline", "run_roofline")
    rl.add_argument("--triad-mb", type=int, default=256, help="size of each triad array")
    rl.add_argument("--matmul-size", type=int, default=1024, help="side of the square matmul timed")
    rl.add_argument("--batch-size", type=int, default=1, help="prompts decoded at once")
    rl.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    rl.add_argument("--output-len", type=int, default=64, help="generated tokens per prompt")
    rl.add_argument("--runs", type=int, default=3, help="timed runs")

    sv = bs.add_parser("serve", help="load client for any OpenAI-compatible endpoint")
    from .bench_serve import add_serve_args

    add_serve_args(sv)
    add_output_args(sv)
    sv.set_defaults(func=_handler("bench_serve", "run_serve"))

    sk = bs.add_parser("soak", help="many clients against a real server for minutes, preemption forced: errors, "
                                    "pool integrity, memory growth")
    from .bench_soak import add_soak_args

    add_soak_args(sk)
    add_output_args(sk)
    sk.set_defaults(func=_handler("bench_soak", "run_soak"))

    qb = _engine_parser(bs, "quant", "weight schemes and cache dtypes: bytes by format, RSS, bytes read per token "
                                     "and the speed-up they allow, decode and prefill speed, teacher-forced "
                                     "agreement, KL and perplexity",
                        "bench_quant", "run_quant")
    from .bench_quant import add_quant_args

    add_quant_args(qb)

    sd = _engine_parser(bs, "spec", "speculative decoding: each proposer's decode speed-up, acceptance length and "
                                    "rate against none, on validation-text prompts", "bench_spec", "run_spec")
    from .bench_spec import add_spec_args

    add_spec_args(sd)

    vb = _engine_parser(bs, "vision", "the image path: processor and tower time per image size, and time to first "
                                      "token with 0, 1 and 4 images", "bench_vision", "run_vision")
    from .bench_vision import add_vision_args

    add_vision_args(vb)

    bb = _engine_parser(bs, "backends", "native vs torch backend: teacher-forced greedy agreement, |delta logprob|, "
                                        "free-running identical prefix (--backend is ignored: both run)",
                        "bench_backends", "run_backends")
    from .bench_backends import add_backends_args

    add_backends_args(bb)

    ob = bs.add_parser("ops", help="each fast op vs its reference twin at k31-small shapes")
    ob.add_argument("--repeats", type=int, default=3, help="timings of each op (the median is shown)")
    ob.set_defaults(func=_ops)
