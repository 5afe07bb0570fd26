"""Tokenizers of the shipped models: Hugging Face ``tokenizers`` files (tokenizer.json), and the
chat template in tokenizer_config.json (``chat_template``, as Hugging Face keeps it), rendered as
transformers renders it (a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_TEXT = "<|endoftext|>"
BOS_TEXT = "<|bos|>"
SPECIAL_TOKENS = [EOS_TEXT, BOS_TEXT, "<|pad|>"]
# A turn is the BOS special token, the role and a newline, the content, and the EOS special token
# (one token each in both vocabularies, so turns never merge into the text around them); the
# generation prompt opens the assistant's turn, and the model ends it with EOS.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- bos_token + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- bos_token + 'assistant\\n' -}}{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """The chat template could not render the messages."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (ByteLevel's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def build_byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: token id == byte value, specials at 256, 257, 258."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


class TextTokenizer:
    """Encode/decode with the model directory's tokenizer.json."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the model directory has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.eos_token = cfg.get("eos_token", EOS_TEXT)
        self.bos_token = cfg.get("bos_token", BOS_TEXT)
        self.eos_token_id = self._tok.token_to_id(self.eos_token)
        self.chat_template: str | None = cfg.get("chat_template")
        self.model_max_length: int | None = cfg.get("model_max_length")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int] | None:
        """The raw bytes of a token through byte-level BPE's alphabet (a fragment of a UTF-8
        character included), or None if its piece is not in that alphabet."""
        piece = self._tok.id_to_token(token_id)
        table = _byte_decoder()
        if not piece or not all(ch in table for ch in piece):
            return None
        return [table[ch] for ch in piece]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of a conversation (OpenAI-style ``messages``)."""
        if self.chat_template is None:
            raise ChatTemplateError("the model has no chat template (tokenizer_config.json "
                                    "chat_template)")
        try:
            template = _jinja().from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    return {ch: b for b, ch in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _jinja() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env
