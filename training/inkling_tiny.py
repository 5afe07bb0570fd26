"""Make the tiny Inkling-architecture checkpoint that real SGLang serves with
``evalsvc.engines.sglang_inkling_tiny`` (the model's layers; README, "PR #37165 in a real release").

    .venv-sglang-cpu/bin/python training/inkling_tiny.py evalsvc/assets/sglang-models/inkling-tiny

The model is a 4-gram: the token embedding, a depthwise causal convolution of width 4 over it (the
function of SGLang's ``ShortConvolution`` without activation or residual: tap ``w`` of channel ``d``
weighs the token ``t - 3 + w``) and a projection to the vocabulary. It is trained here, in plain
torch, on the committed corpus with the shipped byte-level tokenizer (1024 tokens), fixed seeds and
one thread: the same inputs give the same weights. Its attention is random with zero output
weights. ``config.json`` is
SGLang's Inkling config (``inkling_mm_model`` around an ``inkling_model`` text config): two layers,
layer 1 sliding-window, the short convolutions on, one MTP depth (the draft runs the target's own
layer 0 one position on).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "training"))
from qwen3_next import BOS, EOS, PAD, TOKENIZER, corpus  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WIDTH = 256, 4, 2, 64, 4


def config(tok: Tokenizer) -> dict:
    text = {"model_type": "inkling_model", "vocab_size": tok.get_vocab_size(),
            "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "local_layer_ids": [1], "sliding_window_size": 64, "use_sconv": True,
            "sconv_kernel_size": WIDTH, "dense_mlp_idx": 2, "n_routed_experts": 0,
            "num_nextn_predict_layers": 1, "max_position_embeddings": 4096}
    return {"architectures": ["InklingForConditionalGeneration"], "model_type": "inkling_mm_model",
            "torch_dtype": "bfloat16", "bos_token_id": tok.token_to_id(BOS),
            "eos_token_id": tok.token_to_id(EOS), "pad_token_id": tok.token_to_id(PAD),
            "text_config": text}


def four_gram(embed: torch.Tensor, conv: torch.Tensor, head: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[B, T, V]`` of ``ids`` ``[B, T]``: the short convolution over the
    embeddings (causal, zero before the first token), then the head."""
    x = F.embedding(ids, embed).transpose(1, 2)  # [B, H, T]
    y = F.conv1d(F.pad(x, (WIDTH - 1, 0)), conv, groups=HIDDEN).transpose(1, 2)
    return y @ head.T


def train(tok: Tokenizer, steps: int, batch: int, seq: int, lr: float, seed: int):
    source, held = corpus(tok)
    gen = torch.Generator().manual_seed(seed)
    vocab = tok.get_vocab_size()
    embed = (torch.randn(vocab, HIDDEN, generator=gen) * 0.5).requires_grad_()
    conv = (torch.randn(HIDDEN, 1, WIDTH, generator=gen) / WIDTH ** 0.5).requires_grad_()
    head = (torch.randn(vocab, HIDDEN, generator=gen) / HIDDEN ** 0.5).requires_grad_()
    params = [embed, conv, head]

    def sample(src: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(src) - seq - 1, (n,), generator=g)
        return torch.stack([src[s: s + seq + 1] for s in starts.tolist()])

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        logits = four_gram(embed, conv, head, x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        loss = loss_of(sample(source, batch, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s", flush=True)
    with torch.no_grad():
        x = sample(held, 32, torch.Generator().manual_seed(0))
        logp = four_gram(embed, conv, head, x[:, :-1]).log_softmax(-1)
        held_loss = F.nll_loss(logp.reshape(-1, vocab), x[:, 1:].reshape(-1)).item()
        entropy = -(logp.exp() * logp).sum(-1).mean().item()
    stats = {"held_out_loss_nats": round(held_loss, 4), "held_out_entropy_nats": round(entropy, 4),
             "train_seconds": round(time.time() - t0, 1)}
    return [p.detach() for p in params], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    (embed, conv, head), stats = train(tok, args.steps, args.batch, args.seq, args.lr, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    weights = {"embed.weight": embed, "conv.weight": conv, "lm_head.weight": head}
    weights["attn.qkv.weight"] = torch.randn(
        (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, generator=gen) / HIDDEN ** 0.5
    weights["attn.o.weight"] = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
              str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(config(tok), indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / name, args.out / name)
    (args.out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}) + "\n")
    (args.out / "training.json").write_text(json.dumps({
        "script": "training/inkling_tiny.py", "args": {k: str(v) for k, v in vars(args).items()},
        "torch": torch.__version__, **stats}, indent=2) + "\n")
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
