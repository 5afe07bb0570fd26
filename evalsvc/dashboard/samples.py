"""One sample's tokens for the drill-down: its row of the run's Parquet file, per-token KL of its
generated tokens and of its extend, and the tokens as text when the model's tokenizer is on this
machine."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from evalsvc.metrics import token_kl
from evalsvc.paths import shipped_model_dir
from evalsvc.tokenization import TokenizerError, load_tokenizer

KL_FLOOR = 1e-12  # per-token k3 at or below this is coloured as no divergence
KL_CEILING = 1e-2  # and at or above this as the strongest


def read_sample(path: str | Path, scenario: str, sample_id: str) -> dict[str, Any] | None:
    """The sample's row of a run's Parquet file (``record.write_samples_parquet``), None if absent."""
    import pandas as pd

    df = pd.read_parquet(path, filters=[("scenario", "==", scenario), ("sample_id", "==", sample_id)])
    if df.empty:
        return None
    return df.iloc[0].to_dict()


def token_texts(model_path: str | None, ids: list[int]) -> list[str] | None:
    """Each token id as text, with the tokenizer of a shipped model or a local model directory;
    None when there is none here (a hub model is never fetched for a page)."""
    if not model_path or (shipped_model_dir(model_path) is None and not Path(model_path).is_dir()):
        return None
    try:
        tok = load_tokenizer(model_path)
    except TokenizerError:
        return None
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def colour(k3: float) -> str:
    """A background colour for a token's k3 (nats): green at KL_FLOOR, red at KL_CEILING, on a log
    scale."""
    span = math.log10(KL_CEILING) - math.log10(KL_FLOOR)
    level = min((math.log10(max(k3, KL_FLOOR)) - math.log10(KL_FLOOR)) / span, 1.0)
    return f"hsl({120 - 120 * level:.0f}, 70%, {90 - 25 * level:.0f}%)"


def sample_tokens(row: dict[str, Any], model_path: str | None) -> list[dict[str, Any]]:
    """Per generated token: position, id, text (None without a tokenizer), both sides' logprobs
    (natural log) and the k1 / k2 / k3 estimators of KL(decode || reference) in nats."""
    ids = [int(i) for i in row["output_ids"]]
    dec = np.asarray(row["decode_logprobs"], dtype=np.float64)
    ref = np.asarray(row["reference_logprobs"], dtype=np.float64)
    kl = token_kl(dec, ref)
    texts = token_texts(model_path, ids)
    return [{"position": i, "id": tid, "text": texts[i] if texts else None,
             "decode_logprob": float(dec[i]), "reference_logprob": float(ref[i]),
             "k1": float(kl["k1"][i]), "k2": float(kl["k2"][i]), "k3": float(kl["k3"][i]),
             "colour": colour(float(kl["k3"][i]))} for i, tid in enumerate(ids)]


def extend_tokens(row: dict[str, Any], model_path: str | None) -> list[dict[str, Any]]:
    """Per extend token (the prompt tokens prefilled on the cached prefix; position 0 is the first
    after it): position, id and text (None where the run did not record them, or without a
    tokenizer), both sides' logprobs (natural log) and the k3 estimator of KL(served ||
    reference) in nats; empty without an extend."""
    served = row.get("extend_logprobs")
    if served is None or len(served) == 0:
        return []
    served = np.asarray(served, dtype=np.float64)
    ref = np.asarray(row["extend_reference_logprobs"], dtype=np.float64)
    k3 = token_kl(served, ref)["k3"]
    recorded = row.get("extend_ids")  # runs recorded before the ids were kept have none
    ids = ([int(i) for i in recorded] if recorded is not None and len(recorded) == len(served)
           else [None] * len(served))
    texts = token_texts(model_path, ids) if None not in ids else None
    return [{"position": i, "id": tid, "text": texts[i] if texts else None,
             "logprob": float(served[i]), "reference_logprob": float(ref[i]),
             "k3": float(k3[i]), "colour": colour(float(k3[i]))} for i, tid in enumerate(ids)]


def top_candidates(row: dict[str, Any], position: int, model_path: str | None
                   ) -> dict[str, list[dict[str, Any]]] | None:
    """Both sides' top-k candidates at a position: per side, rank-ordered (id, text, logprob,
    probability); None when the run did not record them."""
    out = {}
    for side in ("decode", "reference"):
        ids, lps = row.get(f"{side}_top_ids"), row.get(f"{side}_top_logprobs")
        if ids is None or lps is None or position >= len(ids):
            return None
        pos_ids = [int(i) for i in ids[position]]
        texts = token_texts(model_path, pos_ids) or [None] * len(pos_ids)
        out[side] = [{"id": i, "text": t, "logprob": float(lp),
                      "probability": math.exp(float(lp))}
                     for i, t, lp in zip(pos_ids, texts, lps[position], strict=True)
                     if lp is not None]
    return out
