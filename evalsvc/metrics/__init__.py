"""Pure numpy metrics: KL divergence between runs (nats), summary statistics, and speculative-
decoding acceptance."""

from evalsvc.metrics.acceptance import (
    per_position_acceptance,
    sglang_accept_length,
    sglang_accept_rate,
    summarize_acceptance,
    vllm_acceptance_rate,
    vllm_mean_acceptance_length,
)
from evalsvc.metrics.kl import (
    PositionKL,
    SampleKL,
    bit_exact_fraction,
    first_divergence,
    kl_by_position,
    same_top_token,
    token_kl,
    token_kl_by_sample,
    top_arrays,
    topk_kl,
    topk_kl_and_same_top,
)
from evalsvc.metrics.stats import (
    bootstrap_mean_ci,
    paired_difference_ci,
    paired_difference_cis,
    percentiles,
    summarize_kl,
    summarize_pooled_kl,
)

__all__ = [
    "PositionKL",
    "SampleKL",
    "bit_exact_fraction",
    "bootstrap_mean_ci",
    "first_divergence",
    "kl_by_position",
    "paired_difference_ci",
    "paired_difference_cis",
    "per_position_acceptance",
    "percentiles",
    "same_top_token",
    "sglang_accept_length",
    "sglang_accept_rate",
    "summarize_acceptance",
    "summarize_kl",
    "summarize_pooled_kl",
    "token_kl",
    "token_kl_by_sample",
    "top_arrays",
    "topk_kl",
    "topk_kl_and_same_top",
    "vllm_acceptance_rate",
    "vllm_mean_acceptance_length",
]
