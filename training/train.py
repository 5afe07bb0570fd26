"""Train the shipped embedded-engine models, deterministically, on the committed corpus.

    python training/train.py --family mamba2          # -> evalsvc/assets/models/hybrid-mamba2-tiny
    python training/train.py --family gated_deltanet  # -> evalsvc/assets/models/hybrid-gdn-tiny

Two CPU threads, fixed seeds and a fixed number of steps: the same inputs give the same weights.
Loss: next-token cross-entropy plus half the MTP head's next-next-token cross-entropy (the head
reads the target's hidden state, detached, so drafting never degrades the target).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.engines.embedded.model import HybridConfig, HybridLM, save_model  # noqa: E402
from evalsvc.engines.embedded.tokenizer import (  # noqa: E402
    CHAT_TEMPLATE,
    EOS_TEXT,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
)

NAMES = {"mamba2": "hybrid-mamba2-tiny", "gated_deltanet": "hybrid-gdn-tiny"}
SEPARATOR = "\n<|endoftext|>\n"


def build_tokenizer(family: str, texts: list[str]) -> Tokenizer:
    if family == "mamba2":
        return build_byte_tokenizer()
    from tokenizers import Tokenizer as Tok
    from tokenizers import decoders, models

    tok = Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(NAMES), required=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = args.out or ROOT / "evalsvc" / "assets" / "models" / NAMES[args.family]

    text = gzip.decompress((ROOT / "training" / "corpus.txt.gz").read_bytes()).decode("utf-8")
    files = text.split(SEPARATOR)
    tok = build_tokenizer(args.family, files)
    eos = tok.token_to_id(EOS_TEXT)
    ids = []
    for f in files:
        ids.extend(tok.encode(f, add_special_tokens=False).ids)
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    split = int(len(data) * 0.98)
    train, held = data[:split], data[split:]
    print(f"{args.family}: {len(data)} tokens, vocab {tok.get_vocab_size()}", flush=True)

    cfg = HybridConfig(family=args.family, vocab_size=tok.get_vocab_size(),
                       bos_token_id=tok.token_to_id("<|bos|>"), eos_token_id=eos,
                       pad_token_id=tok.token_to_id("<|pad|>"))
    model = HybridLM(cfg)
    print(f"parameters: {sum(p.numel() for p in model.parameters())}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = 100

    def lr_at(step: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        frac = (step - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def batch_from(source: torch.Tensor, n: int) -> torch.Tensor:
        starts = rng.integers(0, len(source) - args.seq - 1, size=n)
        return torch.stack([source[s: s + args.seq] for s in starts])

    def losses(x: torch.Tensor):
        logits, draft = model.forward_train(x)
        main = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        mtp = F.cross_entropy(draft[:, :-1].reshape(-1, cfg.vocab_size), x[:, 2:].reshape(-1))
        return main, mtp

    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        main, mtp = losses(batch_from(train, args.batch))
        opt.zero_grad(set_to_none=True)
        (main + 0.5 * mtp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {main.item():.3f}  mtp {mtp.item():.3f}  "
                  f"{time.time() - t0:.0f}s", flush=True)

    model.eval()
    with torch.no_grad():
        held_rng = np.random.default_rng(0)
        starts = held_rng.integers(0, len(held) - args.seq - 1, size=32)
        x = torch.stack([held[s: s + args.seq] for s in starts])
        main, mtp = losses(x)
    save_model(model, out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TEXT,
        "bos_token": "<|bos|>", "pad_token": "<|pad|>", "add_bos_token": False,
        "model_max_length": cfg.max_position_embeddings, "chat_template": CHAT_TEMPLATE},
        indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": eos, "bos_token_id": cfg.bos_token_id}, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps({
        "script": "training/train.py", "args": {k: str(v) for k, v in vars(args).items()},
        "held_out_loss_nats": round(main.item(), 4), "held_out_mtp_loss_nats": round(mtp.item(), 4),
        "train_seconds": round(time.time() - t0, 1), "torch": torch.__version__}, indent=2) + "\n")
    print(f"held-out loss {main.item():.3f} nats, mtp {mtp.item():.3f}; saved {out}", flush=True)


if __name__ == "__main__":
    main()
