"""Make a tiny Qwen3-Next checkpoint that real SGLang serves on its CPU path, optionally trained.

    .venv-sglang-cpu/bin/python training/qwen3_next.py OUT [--steps 400]

Runs under the SGLang CPU environment's python (``make sglang-cpu``: it has torch and the
transformers release SGLang 0.5.17 pins), never under the service's. The architecture is
transformers' own ``Qwen3NextForCausalLM``: gated-deltanet and full-attention layers alternating
(4 layers, width 256), MoE in every layer (4 experts, top 2: SGLang's Qwen3-Next loads no dense
layer), linear-attention head dim 64 and conv width 4 (what SGLang's CPU kernels take), one MTP
layer, bf16. The tokenizer is the shipped ``hybrid-gdn-tiny``'s (byte-level BPE, 1024 tokens).

``--steps 0`` leaves the random initial weights (near-uniform next-token distributions); with
steps, it trains on the committed corpus (the Python standard library's sources), two threads,
fixed seeds: the same inputs give the same weights. A model that uses its context is what makes a
wrong recurrent state visible, and its clean KL floor is of the size GPU tests see.

The weights are then written as SGLang's loader reads them: experts unfused
(``experts.E.{gate,up,down}_proj``), and an MTP layer (``mtp.*``: the last full-attention layer,
an ``fc`` over [embedding; hidden] and its norms); ``config.json`` spells out
``full_attention_interval`` and ``rope_theta``, which SGLang reads.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "evalsvc" / "assets" / "models" / "hybrid-gdn-tiny"
SEPARATOR = "\n<|endoftext|>\n"
EOS, BOS, PAD = "<|endoftext|>", "<|bos|>", "<|pad|>"


def make_config(tok: Tokenizer) -> Qwen3NextConfig:
    cfg = Qwen3NextConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
        partial_rotary_factor=0.25, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD))
    cfg.num_nextn_predict_layers = 1
    return cfg


def corpus(tok: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed corpus (the Python standard library's sources), tokenised, each file ended
    by EOS: the first 98 % to train on, the rest held out."""
    text = gzip.decompress((ROOT / "training" / "corpus.txt.gz").read_bytes()).decode("utf-8")
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for f in text.split(SEPARATOR):
        ids.extend(tok.encode(f, add_special_tokens=False).ids)
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    split = int(len(data) * 0.98)
    return data[:split], data[split:]


def train(model: Qwen3NextForCausalLM, tok: Tokenizer, steps: int, batch: int, seq: int,
          lr: float, seed: int) -> dict[str, float]:
    """Next-token cross-entropy on the corpus (98 % train, the rest held out); AdamW with warm-up
    and cosine decay. Returns the held-out loss in nats per token."""
    source, held = corpus(tok)
    gen = torch.Generator().manual_seed(seed)

    def batch_from(src: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(src) - seq - 1, (n,), generator=g)
        return torch.stack([src[s: s + seq] for s in starts.tolist()])

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = min(50, steps)
    t0 = time.time()
    model.train()
    for step in range(steps):
        frac = (step - warm) / max(1, steps - warm)
        for group in opt.param_groups:
            group["lr"] = (lr * (step + 1) / warm if step < warm
                           else lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac))))
        x = batch_from(source, batch, gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s", flush=True)
    model.eval()
    with torch.no_grad():
        x = batch_from(held, 32, torch.Generator().manual_seed(0))
        out = model(input_ids=x, labels=x)
        # the mean entropy of the next-token distributions: how peaked the model is, which sets
        # how far a wrong state moves KL (a near-uniform random model hides most of it)
        logp = out.logits.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1).mean().item()
    return {"held_out_loss_nats": round(out.loss.item(), 4),
            "held_out_entropy_nats": round(entropy, 4), "train_seconds": round(time.time() - t0, 1)}


def sglang_weights(sd: dict[str, torch.Tensor], cfg: Qwen3NextConfig,
                   seed: int) -> dict[str, torch.Tensor]:
    """transformers' state dict in the names and shapes SGLang's Qwen3-Next loader reads."""
    out: dict[str, torch.Tensor] = {}
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):  # fused [E, 2I, H] (or [E, H, 2I])
            prefix = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                w = v[e] if v.shape[1] == 2 * inter else v[e].t()
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif k.endswith("mlp.experts.down_proj"):  # fused [E, H, I] (or [E, I, H])
            prefix = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                w = v[e] if v.shape[1] == hidden else v[e].t()
                out[f"{prefix}{e}.down_proj.weight"] = w.contiguous()
        else:
            out[k] = v
    last = cfg.num_hidden_layers - 1  # a full-attention layer (interval 2)
    for k, v in list(out.items()):
        if k.startswith(f"model.layers.{last}."):
            out["mtp.layers.0." + k[len(f"model.layers.{last}."):]] = v.clone()
    gen = torch.Generator().manual_seed(seed)
    out["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * 0.02).to(torch.bfloat16)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: random weights)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    cfg = make_config(tok)
    model = Qwen3NextForCausalLM(cfg)
    info = {"steps": args.steps}
    if args.steps:
        info.update(train(model, tok, args.steps, args.batch, args.seq, args.lr, args.seed))
    model = model.to(torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    staging = args.out / "transformers"
    model.save_pretrained(staging, safe_serialization=True)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(staging.glob("*.safetensors")):
        sd.update(load_file(f))
    save_file(sglang_weights(sd, cfg, args.seed), args.out / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((staging / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, full_attention_interval=2, rope_theta=10000.0,
                  torch_dtype="bfloat16", dtype="bfloat16")
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(staging)
    shutil.copy(TOKENIZER / "tokenizer.json", args.out / "tokenizer.json")
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": BOS,
        "pad_token": PAD, "add_bos_token": False, "model_max_length": 4096}, indent=2) + "\n")
    (args.out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": cfg.eos_token_id, "bos_token_id": cfg.bos_token_id}, indent=2) + "\n")
    (args.out / "training.json").write_text(json.dumps({
        "script": "training/qwen3_next.py", "args": {k: str(v) for k, v in vars(args).items()},
        **info, "torch": torch.__version__}, indent=2) + "\n")
    print(f"saved {args.out}: {info}", flush=True)


if __name__ == "__main__":
    main()
