"""Prometheus metrics (docs/serving.md §11): the `deltaserve:` family, in a registry owned by one `Metrics` object.

Nothing is registered globally, so several servers (or tests) can live in one process. Counters are created without
the `_total` suffix because prometheus_client appends it: the exposed names are exactly `deltaserve:*_total`.

Sources:
* `observe_engine_stats(stats)` — the engine's snapshot: gauges are set; counters that the engine keeps cumulatively
  (`num_preemptions`, KDA checkpoint hits / evictions, speculative-decoding counts, KV-transfer failures / expiries)
  advance by the delta since the previous snapshot (a value lower than before is taken as an engine restart, and
  counts in full); `iteration_tokens` (an int or a list, the tokens of each step since the last snapshot) feeds the
  histogram.
* per request: `on_first_token(ttft_s)`, `on_token(itl_s)`, `on_finish(reason, e2e_s, prompt_tokens, cached_tokens,
  generation_tokens, ...)`. Token counters and the prefix-cache query / hit counters (in tokens: queries += prompt
  tokens, hits += cached tokens) advance at finish, so they never depend on the engine reporting them.
* prefill/decode disaggregation, from the snapshot: `kv_transfer_bytes` and `kv_expired_requests` (cumulative),
  `kv_transfer_failures_by_stage` ({stage: n}, cumulative), `kv_transfers_in_flight` (a gauge) and
  `kv_transfer_seconds` (the durations of the transfers that ended since the previous snapshot, a histogram);
  `on_engine_restart()` per engine-core restart;
  `set_cache_config(**info)` for the info metric.

Usage gauges (`kv_cache_usage_perc`, `state_slots_usage_perc`) are fractions in [0, 1] as in vLLM, despite the name.
`num_requests_waiting` carries the label `reason`: `stats["num_waiting_by_reason"]` ({reason: n}) when the engine
breaks waiting requests down, else `stats["num_waiting"]` under reason "capacity".

`compat="vllm"` (--metrics-compat vllm) also exposes the series of VLLM_SERIES under vLLM's names: a `RenamedSeries`
collector reads the deltaserve metrics at each scrape and yields their samples renamed, with vLLM's labels, so the two
names of a series always read the same and nothing is defined or counted twice.
"""

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.metrics_core import Metric

PREFIX = "deltaserve:"
VLLM_PREFIX = "vllm:"

# deltaserve series (name after the prefix) that mean what vLLM's series of the same name means (vLLM 0.11+; docs/
# serving.md §11), with the labels summed away to match vLLM's (it has no `reason` on num_requests_waiting). The
# rest (state slots, KDA checkpoints, engine restarts, series not fed yet) has no vLLM twin.
VLLM_SERIES: dict[str, tuple[str, ...]] = {
    "num_requests_running": (), "num_requests_waiting": ("reason",), "kv_cache_usage_perc": (),
    "num_preemptions": (), "prompt_tokens": (), "prompt_tokens_cached": (), "generation_tokens": (),
    "request_success": (), "prefix_cache_queries": (), "prefix_cache_hits": (),
    "time_to_first_token_seconds": (), "inter_token_latency_seconds": (), "e2e_request_latency_seconds": (),
}
COMPAT = {"vllm": VLLM_PREFIX}

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# stats key -> counter name (without prefix / `_total`) for counters the engine reports cumulatively.
CUMULATIVE_COUNTERS = {
    "num_preemptions": "num_preemptions",
    "kda_checkpoint_hits": "kda_checkpoint_hits",
    "kda_checkpoints_evicted": "kda_checkpoints_evicted",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "kv_transfer_bytes": "kv_transfer_bytes",
    "kv_expired_requests": "kv_expired_requests",
}

# stats key -> gauge name.
GAUGES = {
    "num_running": "num_requests_running",
    "kv_cache_usage": "kv_cache_usage_perc",
    "state_slot_usage": "state_slots_usage_perc",
    "checkpoint_slots_used": "checkpoint_slots_used",
    "kv_transfers_in_flight": "kv_transfers_in_flight",
}


class RenamedSeries:
    """A collector that shows other metrics' current samples under another prefix: `sources` maps each metric to
    the labels summed away (gauges only, where a sum is the total), and `labels` are added to every sample."""

    def __init__(self, sources: Mapping[Any, tuple[str, ...]], prefix: str, labels: Mapping[str, str]) -> None:
        self.sources, self.prefix, self.labels = sources, prefix, dict(labels)

    def rename(self, name: str) -> str:
        return self.prefix + name.removeprefix(PREFIX)

    def collect(self) -> Iterator[Metric]:
        for metric, dropped in self.sources.items():
            for family in metric.collect():
                out = Metric(self.rename(family.name), family.documentation, family.type, family.unit)
                values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
                for sample in family.samples:
                    labels = {**self.labels, **{k: v for k, v in sample.labels.items() if k not in dropped}}
                    key = (self.rename(sample.name), tuple(labels.items()))
                    values[key] = values.get(key, 0.0) + sample.value
                for (name, labels), value in values.items():
                    out.add_sample(name, dict(labels), value)
                yield out


class Metrics:
    """The server's metrics; `render()` gives the Prometheus text exposition. `compat` ("vllm" or None) adds the
    same series under another server's names, labelled with `model_name` (the first served name)."""

    def __init__(self, cache_config: Mapping[str, Any] | None = None, compat: str | None = None,
                 model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        by_name: dict[str, Any] = {}  # name after the prefix -> metric, for the compat series

        def gauge(name, doc, labels=()):
            by_name[name] = Gauge(PREFIX + name, doc, list(labels), registry=reg)
            return by_name[name]

        def counter(name, doc, labels=()):
            by_name[name] = Counter(PREFIX + name, doc, list(labels), registry=reg)
            return by_name[name]

        def histogram(name, doc, buckets):
            by_name[name] = Histogram(PREFIX + name, doc, buckets=buckets, registry=reg)
            return by_name[name]

        self.gauges = {
            "num_requests_running": gauge("num_requests_running", "Requests being computed (prefill or decode)."),
            "kv_cache_usage_perc": gauge("kv_cache_usage_perc", "Token pool (MLA latent + indexer pages) usage, 0-1."),
            "state_slots_usage_perc": gauge("state_slots_usage_perc", "KDA state slot pool usage, 0-1."),
            "checkpoint_slots_used": gauge("checkpoint_slots_used", "KDA state checkpoints held by the prefix cache."),
            "kv_transfers_in_flight": gauge("kv_transfers_in_flight", "PD transfers pulled or waiting to be loaded."),
        }
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.", ["reason"])
        self.prefix_cache_ineffective = gauge(
            "prefix_cache_ineffective",
            "1 while prefix caching cannot apply to a class of requests (e.g. prompts shorter than one block).",
            ["reason"])
        self.counters = {name: counter(name, f"Cumulative {name.replace('_', ' ')} reported by the engine.")
                         for name in CUMULATIVE_COUNTERS.values()}
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per draft position.", ["position"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.kv_transfer_failures = counter("kv_transfer_failures", "Failed PD KV transfers by stage (handshake, "
                                            "transfer, load).", ["stage"])
        self.engine_restarts = counter("engine_restarts", "Restarts of the engine-core process after it died.")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens.",
                                             ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.",
                                             REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Time spent waiting before the first "
                                            "schedule.", REQUEST_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds", "Time spent in prefill.",
                                              REQUEST_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds", "Time spent in decode.", REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens", "Tokens scheduled per engine step.", ITERATION_BUCKETS)
        self.kv_transfer_seconds = histogram("kv_transfer_seconds", "Duration of PD KV transfers.", TRANSFER_BUCKETS)
        self.cache_config_info = Info(PREFIX + "cache_config", "Cache configuration.", registry=reg)
        self._last: dict[str, float] = {}
        self._last_accepted_per_pos: list[float] = []
        self._waiting_reasons: set[str] = set()
        self._ineffective_reasons: set[str] = set()
        self.set_cache_config(**(cache_config or {}))
        if compat is not None:
            if compat not in COMPAT:
                raise ValueError(f"metrics compat must be one of {sorted(COMPAT)}, got {compat!r}")
            # vLLM labels every series with the served model and the engine index (one engine here: 0).
            reg.register(RenamedSeries({by_name[n]: dropped for n, dropped in VLLM_SERIES.items()}, COMPAT[compat],
                                       {"model_name": model_name, "engine": "0"}))

    # -----------------------------------------------------------------------------------------------------------------

    def set_cache_config(self, **info: Any) -> None:
        """Set the `cache_config_info` labels (values are stringified)."""
        self.cache_config_info.info({str(k): str(v) for k, v in info.items()})

    @staticmethod
    def _delta(last: float | None, now: float) -> float:
        return now if last is None or now < last else now - last

    def observe_engine_stats(self, stats: Mapping[str, Any] | None) -> None:
        """Take one engine snapshot (see the module docstring for the keys); missing keys are left alone."""
        if not stats:
            return
        for key, name in GAUGES.items():
            if stats.get(key) is not None:
                self.gauges[name].set(stats[key])
        by_reason = stats.get("num_waiting_by_reason")
        if by_reason is None and stats.get("num_waiting") is not None:
            by_reason = {"capacity": stats["num_waiting"]}
        if by_reason is not None:
            self._set_labelled(self.num_requests_waiting, self._waiting_reasons, by_reason)
        if stats.get("prefix_cache_ineffective") is not None:
            self._set_labelled(self.prefix_cache_ineffective, self._ineffective_reasons,
                               {k: float(bool(v)) for k, v in stats["prefix_cache_ineffective"].items()})
        for key, name in CUMULATIVE_COUNTERS.items():
            if stats.get(key) is not None:
                now = float(stats[key])
                self.counters[name].inc(self._delta(self._last.get(key), now))
                self._last[key] = now
        for stage, now in (stats.get("kv_transfer_failures_by_stage") or {}).items():
            key = f"kv_transfer_failures/{stage}"
            self.kv_transfer_failures.labels(stage=stage).inc(self._delta(self._last.get(key), float(now)))
            self._last[key] = float(now)
        for seconds in stats.get("kv_transfer_seconds") or ():
            self.kv_transfer_seconds.observe(seconds)
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos is not None:
            last = self._last_accepted_per_pos
            for pos, now in enumerate(per_pos):
                self.spec_decode_num_accepted_tokens_per_pos.labels(position=str(pos)).inc(
                    self._delta(last[pos] if pos < len(last) else None, float(now)))
            self._last_accepted_per_pos = [float(v) for v in per_pos]
        steps = stats.get("iteration_tokens")
        if steps is not None:
            for n in ([steps] if isinstance(steps, (int, float)) else steps):
                self.iteration_tokens.observe(n)

    @staticmethod
    def _set_labelled(gauge: Gauge, seen: set[str], values: Mapping[str, float]) -> None:
        for reason in seen - set(values):
            gauge.labels(reason=reason).set(0)  # a reason that disappeared reads 0, not its last value
        for reason, value in values.items():
            gauge.labels(reason=str(reason)).set(value)
            seen.add(str(reason))

    def on_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.observe(ttft_s)

    def on_token(self, itl_s: float) -> None:
        self.inter_token_latency.observe(itl_s)

    def on_finish(self, reason: str | None, e2e_s: float, prompt_tokens: int, cached_tokens: int,
                  generation_tokens: int, *, queue_s: float | None = None, prefill_s: float | None = None,
                  decode_s: float | None = None) -> None:
        """One finished request (any finish reason, including abort / error)."""
        self.request_success.labels(finished_reason=str(reason or "unknown")).inc()
        self.e2e_request_latency.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_cached.inc(cached_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)
        for hist, value in ((self.request_queue_time, queue_s), (self.request_prefill_time, prefill_s),
                            (self.request_decode_time, decode_s)):
            if value is not None:
                hist.observe(value)

    def on_engine_restart(self) -> None:
        """The API process started a fresh engine core after the previous one died."""
        self.engine_restarts.inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def metric_names(self) -> Iterable[str]:
        """Every exposed family name (counters with `_total`, the info with `_info`)."""
        for family in self.registry.collect():
            if family.type == "counter":
                yield family.name + "_total"
            elif family.type == "info":
                yield family.name + "_info"
            else:
                yield family.name
