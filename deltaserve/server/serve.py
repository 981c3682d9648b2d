"""`deltaserve serve`: build the server state, the app and run uvicorn (SIGTERM drains in-flight requests for at
most --shutdown-timeout seconds, then the engine process is stopped)."""

from __future__ import annotations

import argparse
from pathlib import Path

from typing import TYPE_CHECKING

from .. import envs
from ..engine.config import EngineArgs
from .connections import connection_options, positive_int, positive_seconds

if TYPE_CHECKING:
    from .handlers import ServerState


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded default model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' on all but /health")
    parser.add_argument("--served-model-name", action="append", default=None)
    parser.add_argument("--max-queue-len", type=int, default=256, help="requests in flight before 503")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20, help="request bodies above this get 413")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    parser.add_argument("--timeout-header", type=positive_seconds, default=10.0,
                        help="seconds a connection has to send a complete request head (after opening or a response)")
    parser.add_argument("--timeout-keep-alive", type=positive_seconds, default=5.0,
                        help="seconds an idle keep-alive connection stays open after a response")
    parser.add_argument("--max-connections", type=positive_int, default=1024,
                        help="open connections at most; at the cap the longest-waiting idle one is closed")
    EngineArgs.add_cli_args(parser)


def build_state(args: argparse.Namespace) -> "ServerState":
    from ..default_model import default_model_path
    from ..models.loader import load_config
    from ..tokenizer import load_tokenizer
    from .engine_client import EngineClient
    from .handlers import ServerState
    from .metrics import Metrics

    path = Path(args.model) if args.model else default_model_path()
    engine_args = EngineArgs.from_cli(args, str(path))
    tokenizer = load_tokenizer(path)
    config = load_config(path)
    names = args.served_model_name or [args.model or "deltaserve-default"]
    client = EngineClient(engine_args, path, tokenizer, log_level=envs.log_level())
    metrics = Metrics(cache_config={"block_size": str(engine_args.block_size),
                                    "kv_cache_memory": str(engine_args.kv_cache_memory_bytes)})
    return ServerState(client, tokenizer, config, path, names, metrics, args.api_key, args.max_queue_len,
                       args.max_request_bytes)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from .api_server import build_app

    app = build_app(build_state(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=envs.log_level().lower(),
                timeout_graceful_shutdown=args.shutdown_timeout, **connection_options(args))
    return 0
