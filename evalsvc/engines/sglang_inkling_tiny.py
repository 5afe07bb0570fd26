"""A tiny model of this project's under Inkling's architecture names, so that real SGLang serves a
draft with Mamba state of its own on a CPU: the case where PR #37165's bug acts.

This module runs inside SGLang's engine processes, never in the service: the SGLang CPU
environment (``evalsvc.builds.sglang_cpu``) carries a copy of it as
``evalsvc_sglang_models.inkling_tiny``, and a matrix whose engines set
``SGLANG_EXTERNAL_MODEL_PACKAGE=evalsvc_sglang_models`` has SGLang's model registry take its two
classes in place of SGLang's own Inkling (whose module imports the CUTLASS DSL and asserts the fa4
or triton attention backends, neither of which a CPU has).

What stays SGLang's own: the Inkling config (``configs/inkling.py``: six short-conv state streams
per layer, hybrid sliding-window attention), the hybrid pools and the unified radix cache with
Inkling's pinned ``extra_buffer`` strategy, the short-conv backend (``InklingShortConvAttnBackend``:
slot indices, metadata, the commit of the accepted step after verify, the prefix-cache tracking),
the short convolution itself (``models/inkling_common/sconv.py``'s ``ShortConvolution`` and its
Triton kernels, run in Triton's interpreter on the CPU), and the multi-layer EAGLE worker with its
draft pools (``MultiLayerEagleWorkerV2``, where ``_apply_deferred_mamba_init_to_draft_pools``
replays the deferred clear and copy-on-write on the draft's state for this architecture only).

What is this project's: the layers between. The target embeds a token, runs SGLang's short
convolution (the ``ATTN`` stream of layer 0: the last four tokens' embeddings, its state the
previous three) and projects it to the vocabulary. Its next token is therefore a function of its
conv state and the current token, a 4-gram, trained on the project's corpus
(``training/inkling_tiny.py``). Its attention runs on SGLang's KV pool with its output weights
zero, so that it adds nothing. Inkling's config needs a sliding-window layer for its hybrid pools
(layer 1); the model computes nothing there: SGLang's torch attention backend, the CPU's, does not
translate a request's tokens into the sliding-window pool's indices.

The MTP draft is the target's own function one position on: its input is the next token (the
chain draft's rotated ids), its state the previous three in the draft's own conv pool. With that
state right it predicts exactly what the target will, and greedy verification accepts every draft
token; a draft state cleared or copied over mid-request predicts from the wrong window and
acceptance falls. That is all it is for: an accept length below its maximum is a state bug.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.models.inkling_common.sconv import SconvType, ShortConvolution
from torch import nn


class Attention(nn.Module):
    """Full attention on SGLang's KV pool; its output projection is zero in the checkpoint."""

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        heads, kv_heads, head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                     config.head_dim)
        self.sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.qkv = nn.Linear(config.hidden_size, sum(self.sizes), bias=False)
        self.o = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        self.attn = RadixAttention(heads, head_dim, head_dim ** -0.5, kv_heads, layer_id)

    def forward(self, x: torch.Tensor, forward_batch) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        return self.o(self.attn(q, k, v, forward_batch))


class FourGram(nn.Module):
    """The embedding, SGLang's short convolution over it (its state in the pool's ``ATTN`` stream
    of ``layer_id``) and the vocabulary projection; the embedding and projection are the target's
    in the draft (``set_embed_and_head``)."""

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.conv = ShortConvolution(config.hidden_size, config.sconv_kernel_size,
                                     SconvType.ATTN, use_residual=False, layer_id=layer_id)
        self.attn = Attention(config, layer_id)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_processor = LogitsProcessor(config)

    def hidden(self, input_ids, positions, forward_batch) -> torch.Tensor:
        x = self.embed(input_ids)
        return self.conv(x, positions, forward_batch) + self.attn(x, forward_batch)

    def get_embed_and_head(self):
        return self.embed.weight, self.lm_head.weight

    def set_embed_and_head(self, embed, head) -> None:
        del self.embed.weight
        del self.lm_head.weight
        self.embed.weight = embed
        self.lm_head.weight = head

    def load_weights(self, weights) -> set[str]:
        """The checkpoint's names are the target's; the draft takes the same (its layer is the
        target's layer 0)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name in params:
                params[name].data.copy_(tensor)
                loaded.add(name)
        return loaded


class InklingForConditionalGeneration(FourGram):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config.text_config, layer_id=0)
        self.config = config

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
        h = self.hidden(input_ids, positions, forward_batch)
        return self.logits_processor(input_ids, h, self.lm_head, forward_batch)


class InklingForConditionalGenerationMTP(FourGram):
    def __init__(self, config, quant_config=None, draft_model_idx: int | None = None,
                 prefix: str = "") -> None:
        super().__init__(config.text_config, layer_id=draft_model_idx or 0)
        self.config = config

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, **kwargs):
        h = self.hidden(input_ids, positions, forward_batch)
        return self.logits_processor(input_ids, h, self.lm_head, forward_batch)


EntryClass = [InklingForConditionalGeneration, InklingForConditionalGenerationMTP]
