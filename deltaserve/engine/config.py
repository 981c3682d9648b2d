"""Engine configuration: the one place engine settings are defined (vLLM's names where the meaning is the same)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

import torch

from .. import envs
from ..errors import ConfigError
from ..disagg.config import KVTransferConfig
from ..spec_decode import SpeculativeConfig
from .faults import FaultInjector

QUANTIZATIONS = ("w8a8-mxfp8", "w4a8-mxfp4", "mxfp")  # the schemes of layers/quantized.py
BACKENDS = ("auto", "torch", "native")  # execution backends (backends/)
CACHE_8BIT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # 8-bit cache value types (docs/ops.md §9)
DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # --dtype; "auto" follows the checkpoint (resolve_dtype)
# Spellings of a dtype in a checkpoint's config.json (`torch_dtype` / `dtype`) or in `dtype=` -> its canonical name.
_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32",
                "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16", "half": "float16"}

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MiB', '2e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"kv_cache_memory: cannot parse {text!r} (use bytes or e.g. 4GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ResolvedDtype:
    """The dtype the weights and activations are served in (`name`: "float32" or "bfloat16") and where it came
    from, in words, for the log and the start-up banner (`reason`)."""

    name: str
    reason: str


def resolve_dtype(requested: str, checkpoint_dtype: str | None) -> ResolvedDtype:
    """The one place `dtype` is decided. An explicit float32 / bfloat16 (or fp32 / bf16) is taken as it is.
    "auto" takes the checkpoint's `torch_dtype` (`dtype` in newer configs): bfloat16 and float32 as they are; a
    float16 checkpoint is served in bfloat16, since the CPU kernels have no float16 forms (bfloat16 keeps float16's
    range and loses 3 bits of mantissa); a checkpoint that names no dtype is served in float32. Raises ConfigError for
    a dtype that cannot be served (float16 asked explicitly, or anything unknown)."""
    if requested != "auto":
        name = _DTYPE_NAMES.get(str(requested).lower())
        if name not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {requested!r}")
        return ResolvedDtype(name, "set explicitly")
    if checkpoint_dtype is None:
        return ResolvedDtype("float32", "auto: the checkpoint names no dtype")
    stored = _DTYPE_NAMES.get(str(checkpoint_dtype).lower().removeprefix("torch."))
    if stored == "float16":
        return ResolvedDtype("bfloat16", f"auto: the checkpoint's torch_dtype is {checkpoint_dtype}, served in bfloat16 "
                                         f"on the CPU")
    if stored is None:
        raise ConfigError(f"dtype 'auto': the checkpoint's dtype {checkpoint_dtype!r} cannot be served; pass dtype "
                          f"float32 or bfloat16")
    return ResolvedDtype(stored, f"auto: the checkpoint's torch_dtype is {checkpoint_dtype}")


@dataclass
class EngineArgs:
    model: str | None = None  # checkpoint folder; None = the embedded default model
    dtype: str = "auto"  # "auto" (the checkpoint's, see resolve_dtype), "float32" or "bfloat16"
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 64
    kv_cache_memory: str | int = "2GiB"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    state_checkpoint_interval: int | None = None  # tokens between KDA checkpoints; default one block
    max_state_checkpoints: int | None = None  # default: 20% of kv_cache_memory, at most 4 per sequence
    ops: str = "fast"  # "reference" runs every op's readable twin (debugging)
    kv_cache_dtype: str = "auto"  # MLA latent (+ indexer keys): "auto" (model dtype), "int8" or "fp8" (C8)
    index_cache_dtype: str = "auto"  # DSA indexer keys: "auto" (follow kv_cache_dtype), "int8"/"fp8", or "model"
    backend: str = "auto"  # "torch", "native", or "auto": native where the kernels suit the CPU (backends/select.py)
    quantization: str | None = None  # MX weights at load: "w8a8-mxfp8", "w4a8-mxfp4", "mxfp" (layers/quantized.py)
    seed: int = 0
    # Speculative decoding: vLLM's JSON object (method, num_speculative_tokens, ...; spec_decode/config.py), as text
    # or a dict; None = off. Parsed into `speculative`.
    speculative_config: str | dict | None = None
    # Tensor parallelism (docs/parallel.md): this many ranks on this machine, the engine process rank 0 (gloo);
    # routed experts placed whole across them with enable_expert_parallel; a collective that takes longer than
    # distributed_timeout seconds stops the engine.
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_timeout: float = 60.0
    # Over several machines: nnodes launches, each starting tensor_parallel_size / nnodes ranks; node 0 runs the
    # engine (rank 0), the others only workers; all meet at master_addr:master_port (None: a free local port).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # Prefill/decode disaggregation: vLLM's JSON object (kv_role, kv_ip, kv_port, ...; disagg/config.py), as text or
    # a dict; None = off. Parsed into `kv_transfer`.
    kv_transfer_config: str | dict | None = None
    # Tests only: "PHASE:TOKEN_ID,..." raises inside that step phase for requests whose prompt holds the token
    # (engine/faults.py). None (the default) builds no injector and costs nothing.
    fault_injection: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.state_checkpoint_interval is None:
            self.state_checkpoint_interval = self.block_size
        if self.state_checkpoint_interval < 1 or self.state_checkpoint_interval % self.block_size:
            raise ConfigError(f"state_checkpoint_interval must be a positive multiple of block_size "
                              f"({self.block_size}), got {self.state_checkpoint_interval}")
        if self.max_state_checkpoints is not None and self.max_state_checkpoints < 1:
            raise ConfigError(f"max_state_checkpoints must be >= 1, got {self.max_state_checkpoints}")
        if self.kv_cache_dtype not in ("auto", *CACHE_8BIT):
            raise ConfigError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.index_cache_dtype not in ("auto", "model", *CACHE_8BIT):
            raise ConfigError(f"index_cache_dtype must be 'auto', 'model', 'int8' or 'fp8', got "
                              f"{self.index_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {self.quantization!r}")
        if self.ops not in ("fast", "reference"):
            raise ConfigError(f"ops must be 'fast' or 'reference', got {self.ops!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.backend == "native" and self.ops == "reference":
            raise ConfigError("ops 'reference' runs on the torch backend; it cannot run with backend 'native'")
        if self.dtype != "auto":
            resolve_dtype(self.dtype, None)  # an unknown name fails here, not in the engine process
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory)
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer = KVTransferConfig.parse(self.kv_transfer_config)
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout <= 0:
            raise ConfigError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"nnodes must be >= 1 and divide tensor_parallel_size ({self.tensor_parallel_size}), "
                              f"got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, nnodes = {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("nnodes > 1 needs master_port (the port node 0 listens on; or MASTER_PORT)")
        if self.tensor_parallel_size > 1:
            if self.kv_transfer is not None:
                raise ConfigError("kv_transfer_config does not run with tensor_parallel_size > 1: each rank's cache "
                                  "would have to travel")
            if self.speculative is not None and self.speculative.method == "dspark":
                raise ConfigError("speculative_config method 'dspark' does not run with tensor_parallel_size > 1: "
                                  "the drafter is not sharded (suffix and mtp drafting do)")
        FaultInjector.parse(self.fault_injection)  # a malformed spec fails here, not in the engine process

    def latent_cache_8bit(self) -> torch.dtype | None:
        """Value type of the C8 latent cache, or None for the model dtype."""
        return CACHE_8BIT.get(self.kv_cache_dtype)

    def index_cache_8bit(self) -> torch.dtype | None:
        """Value type of 8-bit indexer keys, or None for the model dtype."""
        choice = self.kv_cache_dtype if self.index_cache_dtype == "auto" else self.index_cache_dtype
        return CACHE_8BIT.get(choice)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The engine flags. Each help text either gets its default appended by --help (cli.py's formatter) or, for
        switches and flags whose default is worked out at load, says it in words."""
        d = EngineArgs()
        parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=d.dtype,
                            help="weights and activations: 'auto' takes the checkpoint's torch_dtype (bfloat16 stays "
                                 "bfloat16, float32 stays float32, float16 becomes bfloat16; none named: float32)")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="context length (default: the checkpoint's max_position_embeddings, lowered to what "
                                 "the page pool holds)")
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences running at once")
        parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                            help="tokens computed per engine step")
        parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per page")
        parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                            help="bytes for the page pool, the KDA state slots and the prefix-cache checkpoints, "
                                 "e.g. 4GiB")
        parser.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                            help="a prompt that does not fit the step's token budget waits instead of being split "
                                 "(default: split)")
        parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                            default=True, help="share cached pages and KDA state checkpoints (default: on)")
        parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                            help="turn prefix caching off")
        parser.add_argument("--state-checkpoint-interval", type=int, default=None,
                            help="tokens between KDA state checkpoints (a multiple of --block-size; default: one "
                                 "block)")
        parser.add_argument("--max-state-checkpoints", type=int, default=None,
                            help="KDA state checkpoints kept for the prefix cache (default: from --kv-cache-memory, "
                                 "at most 4 per sequence)")
        parser.add_argument("--ops", choices=["fast", "reference"], default=d.ops,
                            help="op implementations; 'reference' switches every op to its readable twin")
        parser.add_argument("--kv-cache-dtype", choices=["auto", *CACHE_8BIT], default=d.kv_cache_dtype,
                            help="C8 cache: MLA latent in 8 bits with a scale per 128 values (k_pe kept in the model "
                                 "dtype) and indexer keys in 8 bits with a scale per token; 'auto': the model dtype")
        parser.add_argument("--index-cache-dtype", choices=["auto", "model", *CACHE_8BIT], default=d.index_cache_dtype,
                            help="DSA indexer key cache alone: 8 bits after a Hadamard rotation, or the model dtype; "
                                 "'auto': as --kv-cache-dtype")
        parser.add_argument("--backend", choices=BACKENDS, default=d.backend,
                            help="how the model runs: 'native' (the CPU kernels built at first use with the system C "
                                 "compiler), 'torch' (the modules), or 'auto' (native where the kernels suit this CPU; "
                                 "the log and /version say which and why)")
        parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                            help="quantise at load: w8a8-mxfp8 (attention linears, shared experts, dense MLPs), "
                                 "w4a8-mxfp4 (routed experts) or mxfp (both); a quantised checkpoint needs none "
                                 "(default: none)")
        parser.add_argument("--seed", type=int, default=d.seed,
                            help="seeds the generator that requests without a seed draw from")
        parser.add_argument("--speculative-config", default=None,
                            help='speculative decoding as a JSON object, vLLM\'s keys: e.g. \'{"method": "suffix", '
                                 '"num_speculative_tokens": 4}\' (default: off)')
        parser.add_argument("--kv-transfer-config", default=None,
                            help='prefill/decode disaggregation as a JSON object, vLLM\'s keys: e.g. \'{"kv_role": '
                                 '"kv_producer", "kv_port": 14579}\' on a prefill instance, \'{"kv_role": '
                                 '"kv_consumer"}\' on a decode instance (docs/disaggregation.md; default: off)')
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                            help="ranks that share every layer (heads, widths, vocabulary), started on this machine "
                                 "and joined over gloo (docs/parallel.md)")
        parser.add_argument("--enable-expert-parallel", action="store_true",
                            help="with --tensor-parallel-size: routed experts placed whole across the ranks instead "
                                 "of split in width (default: split)")
        parser.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout,
                            help="seconds a step's collective may take before the engine fails its requests and "
                                 "stops")
        env = envs.rendezvous()
        parser.add_argument("--nnodes", type=int, default=d.nnodes,
                            help="machines the --tensor-parallel-size ranks span, each launched with its "
                                 "--node-rank; node 0 serves, the others run workers only")
        parser.add_argument("--node-rank", type=int, default=env.get("node_rank", d.node_rank),
                            help="this machine's place among --nnodes (default: NODE_RANK or GROUP_RANK, else 0)")
        parser.add_argument("--master-addr", default=env.get("master_addr", d.master_addr),
                            help="address of node 0, where the ranks meet (default: MASTER_ADDR, else 127.0.0.1)")
        parser.add_argument("--master-port", type=int, default=env.get("master_port", d.master_port),
                            help="port on node 0 where the ranks meet (default: MASTER_PORT, else a free local "
                                 "port; needed with --nnodes > 1)")
        parser.add_argument("--fault-injection", default=None, help=argparse.SUPPRESS)  # tests: engine/faults.py

    @classmethod
    def from_cli(cls, args: argparse.Namespace, model: str | None) -> "EngineArgs":
        names = {f.name for f in fields(cls)} - {"model"}
        return cls(model=model, **{n: getattr(args, n) for n in names if hasattr(args, n)})
