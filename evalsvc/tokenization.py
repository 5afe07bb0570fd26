"""Client-side tokenizers: prompts go to engines as token ids, so references align by token."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from evalsvc.engines.registry import DEFAULT_ENGINE, engine_kind
from evalsvc.paths import shipped_model_dir

if TYPE_CHECKING:
    from evalsvc.engines.base import EngineSpec
    from evalsvc.matrix import MatrixFile


class TokenizerError(ValueError):
    pass


@lru_cache(maxsize=16)
def load_tokenizer(model_path: str, engine: str = DEFAULT_ENGINE) -> Tokenizer:
    """tokenizer.json of a shipped model (by name), of a local model directory, or from the hub."""
    directory = shipped_model_dir(model_path) if engine_kind(engine).shipped_models else None
    directory = directory or (Path(model_path) if Path(model_path).is_dir() else None)
    if directory is not None:
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"model {model_path}: no tokenizer.json in {directory}")
        return Tokenizer.from_file(str(file))
    try:
        return Tokenizer.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - named in the message
        raise TokenizerError(f"model {model_path}: not a local directory, and its tokenizer could "
                             f"not be fetched from the hub ({exc})") from None


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def tokenized(matrix: MatrixFile, spec: EngineSpec, prompts,
              errors: dict[str, str] | None = None) -> dict[str, list[tuple[str, list[int]]]]:
    """Prompts as token ids per model key; with ``errors``, a model whose tokenizer cannot be loaded
    is recorded there (key -> message) instead of raising."""
    out = {}
    for key, entry in matrix.models.items():
        try:
            tok = load_tokenizer(entry.path, spec.kind)
        except TokenizerError as exc:
            if errors is None:
                raise
            errors[key] = str(exc)
            continue
        out[key] = [(p.id, encode(tok, p.text)) for p in prompts]
    return out
