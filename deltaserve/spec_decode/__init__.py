"""Speculative decoding (docs/serving.md §9): proposers draft tokens to follow a request's newest one, the next step
computes the newest token and its drafts together, and the engine keeps the drafts its sampler would have produced
(engine/core.py), rolling the KDA state back to the last accepted one.

A proposer is chosen once at engine start from the SpeculativeConfig (`build_proposer`)."""

from __future__ import annotations

from .config import METHODS, SpeculativeConfig
from .dspark import DSparkProposer
from .mtp import MTPProposer
from .proposer import DraftRequest, Proposal, Proposer, TargetStep, TokenSource
from .stats import SpecDecodeStats
from .suffix import SuffixProposer


def build_proposer(config: SpeculativeConfig, model=None, cache=None, backend=None, drafter=None,
                   drafter_layer: int = 0, default_generator=None, send_draft=None) -> Proposer:
    """The proposer of `config`: MTP drafts with `model`'s MTP layer over `cache` (the engine's PagedCache), run by
    the engine's `backend`, each run first sent to the other tensor-parallel ranks by `send_draft` (when there are
    any); DSpark with `drafter` (models/dspark.py), its latent rows in layers `drafter_layer ...` of the page pool,
    unseeded requests drawing from `default_generator`."""
    if config.method == "mtp":
        return MTPProposer(model, cache, backend, send_draft)
    if config.method == "dspark":
        return DSparkProposer(model, drafter, cache, drafter_layer, default_generator, config.dspark_min_confidence,
                              config.dspark_max_skip)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    raise ValueError(f"no proposer for method {config.method!r}")


__all__ = ["METHODS", "DSparkProposer", "DraftRequest", "MTPProposer", "Proposal", "Proposer", "SpecDecodeStats",
           "SpeculativeConfig", "SuffixProposer", "TargetStep", "TokenSource", "build_proposer"]
