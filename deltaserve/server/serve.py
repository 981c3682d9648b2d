"""`deltaserve serve`: build the server state, the app and run uvicorn (server/lifecycle.py: SIGTERM drains in-flight
requests for at most --shutdown-timeout seconds and answers the rest with 503, then the engine process is stopped; a
dead engine core is restarted at most --max-engine-restarts times within --engine-restart-window seconds, after
which the server exits with status 1)."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from typing import TYPE_CHECKING

from .. import envs
from ..engine.config import EngineArgs
from .connections import connection_options
from .limits import RequestLimits
from .metrics import COMPAT

if TYPE_CHECKING:
    from .handlers import ServerState

log = logging.getLogger(__name__)


def positive_int(text: str) -> int:
    """argparse type of a limit or count: an integer >= 1 (a limit of 0 would refuse every request)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type of a timeout flag: a finite number of seconds > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded default model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="required as 'Authorization: Bearer KEY' on all but /health (default: none)")
    parser.add_argument("--served-model-name", action="append", default=None,
                        help="a name requests may use for the model, repeatable (default: the MODEL argument, or "
                             "deltaserve-default)")
    parser.add_argument("--max-queue-len", type=positive_int, default=256,
                        help="sequences (every prompt of a request times n) queued or running before 503")
    parser.add_argument("--max-n", type=positive_int, default=RequestLimits.max_n,
                        help="largest n a request may ask for")
    parser.add_argument("--max-prompts-per-request", type=positive_int, default=RequestLimits.max_prompts_per_request,
                        help="most prompts in one completions request's prompt list")
    parser.add_argument("--max-tokens-per-request", type=positive_int, default=RequestLimits.max_tokens_per_request,
                        help="most tokens one request may use: prompt plus max_tokens, summed over its sequences")
    parser.add_argument("--max-prompt-logprobs-tokens", type=positive_int,
                        default=RequestLimits.max_prompt_logprobs_tokens,
                        help="most prompt tokens one request may ask logprobs for (prompt_logprobs, echo + logprobs)")
    parser.add_argument("--allowed-media-domains", nargs="*", default=[],
                        help="hosts whose http(s) image URLs the server fetches (default: none; images come as data "
                             "URLs)")
    parser.add_argument("--max-images-per-request", type=positive_int, default=RequestLimits.max_images_per_request,
                        help="most images one chat request may hold (a model with a vision tower)")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20, help="request bodies above this get 413")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to drain on SIGTERM; requests still running then get a 503 error")
    parser.add_argument("--max-engine-restarts", type=int, default=3,
                        help="restarts of a dead engine-core process allowed within --engine-restart-window; one "
                             "more death makes the server exit with status 1 (0: exit at the first)")
    parser.add_argument("--engine-restart-window", type=float, default=600.0,
                        help="seconds over which --max-engine-restarts is counted")
    parser.add_argument("--timeout-header", type=positive_seconds, default=10.0,
                        help="seconds a connection has to send a complete request head (after opening or a response)")
    parser.add_argument("--timeout-keep-alive", type=positive_seconds, default=5.0,
                        help="seconds an idle keep-alive connection stays open after a response")
    parser.add_argument("--max-connections", type=positive_int, default=1024,
                        help="open connections at most; at the cap the longest-waiting idle one is closed")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="no access-log line per request (default: one line per request, with its status, "
                             "token counts, TTFT, e2e time and finish reason)")
    parser.add_argument("--metrics-compat", choices=sorted(COMPAT), default=None,
                        help="/metrics also exposes the series whose meaning is the same under vLLM's names "
                             "(vllm:*, label model_name) for dashboards written for vLLM (default: deltaserve: names "
                             "only)")
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
    client = EngineClient(engine_args, path, tokenizer, log_level=envs.log_level(),
                          max_restarts=args.max_engine_restarts, restart_window_s=args.engine_restart_window)
    metrics = Metrics(cache_config={"block_size": str(engine_args.block_size),
                                    "kv_cache_memory": str(engine_args.kv_cache_memory_bytes)},
                      compat=args.metrics_compat, model_name=names[0])
    limits = RequestLimits(args.max_n, args.max_prompts_per_request, args.max_tokens_per_request,
                           args.max_prompt_logprobs_tokens, args.max_images_per_request)
    return ServerState(client, tokenizer, config, path, names, metrics, args.api_key, args.max_queue_len,
                       args.max_request_bytes, limits=limits, allowed_media_domains=tuple(args.allowed_media_domains))


def uvicorn_log_level(level: str) -> int:
    """uvicorn's own loggers stay at WARNING unless DEBUG is asked for: the start-up banner and the access log say
    what its INFO lines would."""
    value = logging.getLevelName(level)
    value = value if isinstance(value, int) else logging.INFO
    return value if value <= logging.DEBUG else max(value, logging.WARNING)


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT (0), or until the engine core can no longer be restarted (1); 3 when start-up
    fails (uvicorn's STARTUP_FAILURE). Logs the start-up banner once the engine is ready and the socket listens."""
    import uvicorn

    from ..version import __version__
    from .access_log import AccessLog
    from .api_server import build_app
    from .banner import format_banner
    from .lifecycle import DeltaserveServer

    log.info("deltaserve %s starting: model %s, the engine core loads it in its own process", __version__,
             args.model or "deltaserve-default (embedded)")
    state = build_state(args)
    app = build_app(state)
    # No uvicorn logging config: its loggers go through the root handler, in this process's format.
    config = uvicorn.Config(app if args.disable_log_requests else AccessLog(app), host=args.host, port=args.port,
                            log_config=None, log_level=uvicorn_log_level(envs.log_level()), access_log=False,
                            **connection_options(args))

    def listening(url: str) -> None:
        log.info("%s", format_banner(state.engine.summary, state.served_names, url, __version__))

    server = DeltaserveServer(config, state.engine, drain_s=args.shutdown_timeout, on_listening=listening)
    server.run()
    return server.exit_code if server.started else uvicorn.config.STARTUP_FAILURE
