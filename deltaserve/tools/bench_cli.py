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
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--runs", type=int, default=3)

    sp = _engine_parser(bs, "shared-prefix", "TTFT and hit rate with prefix caching on vs off", "bench",
                        "run_shared_prefix")
    sp.add_argument("--prefix-len", type=int, default=2000)
    sp.add_argument("--question-len", type=int, default=200)
    sp.add_argument("--num-requests", type=int, default=32)

    lat = _engine_parser(bs, "latency", "one batch end to end, prefill and decode separately", "bench_latency",
                         "run_latency")
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--runs", type=int, default=3)

    lc = _engine_parser(bs, "long-context", "prefill, decode per token and cache bytes vs context length",
                        "bench_long_context", "run_long_context")
    lc.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 131072])
    lc.add_argument("--output-len", type=int, default=16, help="decode steps timed at each context")
    lc.add_argument("--runs", type=int, default=1)

    rl = _engine_parser(bs, "roofline", "machine bandwidth and matmul throughput; decode as a fraction of the "
                                        "bandwidth ceiling", "bench_roofline", "run_roofline")
    rl.add_argument("--triad-mb", type=int, default=256, help="size of each triad array")
    rl.add_argument("--matmul-size", type=int, default=1024)
    rl.add_argument("--batch-size", type=int, default=1)
    rl.add_argument("--input-len", type=int, default=128)
    rl.add_argument("--output-len", type=int, default=64)
    rl.add_argument("--runs", type=int, default=3)

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

    qb = _engine_parser(bs, "quant", "weight schemes and cache dtypes: bytes, decode speed, agreement and KL",
                        "bench_quant", "run_quant")
    from .bench_quant import add_quant_args

    add_quant_args(qb)

    bb = _engine_parser(bs, "backends", "native vs torch backend: teacher-forced greedy agreement, |delta logprob|, "
                                        "free-running identical prefix (--backend is ignored: both run)",
                        "bench_backends", "run_backends")
    from .bench_backends import add_backends_args

    add_backends_args(bb)

    ob = bs.add_parser("ops", help="each fast op vs its reference twin at k31-small shapes")
    ob.add_argument("--repeats", type=int, default=3)
    ob.set_defaults(func=_ops)
