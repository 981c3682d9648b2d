"""`deltaserve` command line: make-model, quantize, generate, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import envs
from .engine.config import QUANTIZATIONS, EngineArgs
from .errors import CheckpointError, ConfigError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help appends each flag's default, except for on/off switches and flags defaulting to None, whose help says
    in words what happens without them (a bare "default: None" or "default: False" tells nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return action.help
        return super()._get_help_string(action)


class CliParser(argparse.ArgumentParser):
    """The parser of `deltaserve` and, through add_subparsers (which builds subparsers of the parent's class), of
    every subcommand under it: all show their defaults in --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def _make_model(args: argparse.Namespace) -> int:
    from .config import ModelConfig
    from .distributed import ParallelConfig
    from .tools.accounting import account, account_ranks, format_accounting, format_rank_accounting
    from .tools.make_model import write_checkpoint
    from .tools.presets import get_preset

    preset = get_preset(args.preset)
    if args.meta:
        config = ModelConfig.from_dict(preset.config)
        print(format_accounting(preset.name, account(config)))
        if args.tensor_parallel_size > 1:
            parallel = ParallelConfig(args.tensor_parallel_size, args.enable_expert_parallel)
            print(format_rank_accounting(preset.name, account_ranks(config, parallel)))
        return 0
    if args.out is None:
        print("make-model: OUT folder is required unless --meta is given", file=sys.stderr)
        return 2
    if preset.name == "k31-pro":
        print("make-model: k31-pro is 2.8T parameters; use --meta to account for it", file=sys.stderr)
        return 2
    out = write_checkpoint(preset, Path(args.out), seed=args.seed, dtype=args.dtype,
                           mxfp4_experts=args.mxfp4_experts, shard_bytes=int(args.shard_size_mb * (1 << 20)))
    print(f"wrote {preset.name} to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .engine.config import EngineArgs
    from .engine.llm_engine import LLMEngine
    from .engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs.from_cli(args, args.model))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed, stop=args.stop or [])
    engine.add_request("cli", args.prompt, params)
    print(args.prompt, end="", flush=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.outputs[0].delta_text, end="", flush=True)
    print()
    return 0


def _worker_node(args: argparse.Namespace) -> int:
    """`serve`, `generate` or `bench` with --node-rank k > 0: this node's ranks of the engine node 0 runs, no API
    and no requests of its own; until node 0 stops them."""
    from .default_model import default_model_path
    from .engine.config import EngineArgs
    from .engine.workers import run_worker_node

    path = Path(args.model) if args.model else default_model_path()
    return run_worker_node(EngineArgs.from_cli(args, str(path)), path)


def _quantize(args: argparse.Namespace) -> int:
    from .tools.quantize import quantize_checkpoint

    out = quantize_checkpoint(args.input, args.output, args.scheme)
    print(f"wrote {args.input} quantised with {args.scheme} to {out}")
    return 0


def _router(args: argparse.Namespace) -> int:
    from .disagg.router import run_router

    return run_router(args)


def _serve(args: argparse.Namespace) -> int:
    from .server.serve import run_server

    return run_server(args)


def build_parser() -> CliParser:
    """`deltaserve` and its subcommands."""
    parser = CliParser(prog="deltaserve")
    sub = parser.add_subparsers(dest="command", required=True)

    from .tools.presets import PRESETS

    mm = sub.add_parser("make-model", help="write a random checkpoint of a preset in the real file layout")
    mm.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the model shape")
    mm.add_argument("out", nargs="?", help="folder to write (required unless --meta)")
    mm.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    mm.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="dtype of the stored weights (default: the preset's, bfloat16)")
    mm.add_argument("--meta", action="store_true", help="build on the meta device and print the accounting")
    mm.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="with --meta: also print what each of this many ranks holds")
    mm.add_argument("--enable-expert-parallel", action="store_true",
                    help="with --meta: routed experts placed whole across the ranks, not split in width")
    mm.add_argument("--mxfp4-experts", action="store_true", help="routed experts in mxfp4-pack-quantized layout")
    mm.add_argument("--shard-size-mb", type=float, default=2048.0, help="largest safetensors shard, in MiB")
    mm.set_defaults(func=_make_model)

    qz = sub.add_parser("quantize", help="write a checkpoint with MX-quantised layers (compressed-tensors layout)")
    qz.add_argument("input", help="checkpoint folder")
    qz.add_argument("output", help="folder to write")
    qz.add_argument("--scheme", required=True, choices=QUANTIZATIONS,
                    help="w8a8-mxfp8: attention linears, shared experts, dense MLPs; w4a8-mxfp4: routed experts; "
                         "mxfp: both")
    qz.set_defaults(func=_quantize)

    gen = sub.add_parser("generate", help="continuation of a prompt, streamed (greedy unless --temperature)")
    gen.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded default model)")
    gen.add_argument("--prompt", default="The quick brown fox", help="text to continue")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed of this request's sampling (default: from --seed's shared generator)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="the OpenAI-compatible server")
    from .server.serve import add_cli_args as add_serve_args

    add_serve_args(srv)
    srv.set_defaults(func=_serve)

    rt = sub.add_parser("router", help="prefill/decode disaggregation: an OpenAI-compatible front over prefill and "
                                       "decode instances")
    rt.add_argument("--prefill", nargs="+", required=True, help="base URLs of the prefill instances (kv_producer)")
    rt.add_argument("--decode", nargs="+", required=True, help="base URLs of the decode instances (kv_consumer)")
    rt.add_argument("--host", default="127.0.0.1", help="address to listen on")
    rt.add_argument("--port", type=int, default=8000, help="port to listen on")
    rt.add_argument("--api-key", default=None,
                    help="required as 'Authorization: Bearer KEY' on all but /health (default: none)")
    rt.set_defaults(func=_router)

    from .tools.bench_cli import add_bench_parsers

    add_bench_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. A configuration or checkpoint the command cannot use (ConfigError, CheckpointError: each
    names what is wrong) is printed as one line on stderr, exit status 2, as argparse reports a bad flag."""
    logging.basicConfig(level=envs.log_level(), format=LOG_FORMAT)
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "node_rank", 0) > 0:  # a further machine of a tensor-parallel group, whatever the command
            return _worker_node(args)
        return args.func(args)
    except (ConfigError, CheckpointError) as exc:
        print(f"deltaserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
