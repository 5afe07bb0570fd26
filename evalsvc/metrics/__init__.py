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
    bit_exact_fraction,
    first_divergence,
    same_top_token,
    token_kl,
    topk_kl,
)
from evalsvc.metrics.stats import (
    bootstrap_mean_ci,
    paired_difference_ci,
    paired_difference_cis,
    percentiles,
    summarize_kl,
)

__all__ = [
    "bit_exact_fraction",
    "bootstrap_mean_ci",
    "first_divergence",
    "paired_difference_ci",
    "paired_difference_cis",
    "per_position_acceptance",
    "percentiles",
    "same_top_token",
    "sglang_accept_length",
    "sglang_accept_rate",
    "summarize_acceptance",
    "summarize_kl",
    "token_kl",
    "topk_kl",
    "vllm_acceptance_rate",
    "vllm_mean_acceptance_length",
]
