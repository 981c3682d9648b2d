"""The start-up banner: what is served, how, and where, logged once when the server starts listening (docs/serving.md
§13). Everything but the served names and the URL comes from the engine core's Ready message (EngineSummary)."""

from __future__ import annotations

from ..engine.summary import EngineSummary


def format_bytes(n: int) -> str:
    """Binary units, as --kv-cache-memory takes them: 2.00 GiB, 292.0 KiB, 512 B."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"


def weights_text(total: int, by_format: dict[str, int]) -> str:
    """The weight bytes and their split by storage format, the largest first: "1.15 GiB (MXFP4 760.0 MiB, bfloat16
    410.2 MiB)", or "23.8 MiB, all bfloat16" for a single format."""
    if len(by_format) == 1:
        return f"{format_bytes(total)}, all {next(iter(by_format))}"
    parts = sorted(by_format.items(), key=lambda kv: (-kv[1], kv[0]))
    return f"{format_bytes(total)} (" + ", ".join(f"{fmt} {format_bytes(n)}" for fmt, n in parts) + ")"


def cache_split(s: EngineSummary) -> str:
    """How --kv-cache-memory was split between the page pool, the KDA working slots and the prefix-cache
    checkpoints."""
    parts = [f"{s.num_pages} pages of {s.block_size} tokens ({format_bytes(s.num_pages * s.page_bytes)}, "
             f"{s.num_pages * s.block_size} tokens)",
             f"{s.num_state_slots} KDA state slots ({format_bytes(s.num_state_slots * s.state_slot_bytes)})"]
    if s.prefix_caching:
        parts.append(f"{s.num_checkpoints} prefix-cache checkpoints "
                     f"({format_bytes(s.num_checkpoints * s.state_slot_bytes)})")
    else:
        parts.append("prefix caching off")
    return f"{format_bytes(s.kv_cache_memory)} = " + " + ".join(parts)


def format_banner(s: EngineSummary, served_names: list[str], url: str, version: str) -> str:
    names = ", ".join(repr(n) for n in served_names)
    architecture = f" ({s.architecture})" if s.architecture else ""
    lines = [
        f"deltaserve {version} serves {names} on {url}",
        f"  model    {s.model_path}: {s.family}{architecture}, {s.layers}",
        f"  dtype    {s.dtype} ({s.dtype_reason})",
        f"  backend  {s.backend}, {s.ops} ops ({s.backend_reason}): {s.backend_prepared}",
        f"  weights  {weights_text(s.weight_bytes, s.weight_bytes_by_format)}; quantization: {s.quantization}; "
        f"KV cache in {s.kv_cache_dtype}",
        f"  cache    {cache_split(s)}",
        f"  context  {s.max_model_len} tokens at most; {s.max_num_seqs} sequences and {s.max_num_batched_tokens} "
        f"tokens per step",
    ]
    return "\n".join(lines)
