"""Train the MTP (next-next-token draft) layer of the shipped tiny Qwen3-Next checkpoint.

    .venv-sglang-cpu/bin/python training/qwen3_next_mtp.py [MODEL] [--steps 300]

Runs under the SGLang CPU environment's python (it has torch and transformers), like
``training/qwen3_next.py``. That script writes an MTP layer that was never trained: ``mtp.layers.0``
is a copy of the last full-attention layer, ``mtp.fc`` is random and the three ``mtp.*norm*``
weights are zero, so SGLang's NEXTN speculative decoding accepts next to no drafts. This script
trains those ``mtp.*`` tensors, and only those, to what SGLang's ``Qwen3NextForCausalLMMTP``
computes at draft position t:

    h_t = the base's final hidden state after its final norm (what its logits come from)
    z   = fc([pre_fc_norm_embedding(embed(x_{t+1})); pre_fc_norm_hidden(h_t)])
    z   = one full-attention Qwen3-Next decoder layer (causal over the draft positions, rope
          position t, MoE MLP with shared expert)      # mtp.layers.0.*
    logits = lm_head(mtp.norm(z))                      # predicts x_{t+2}

with the loss the cross-entropy against x_{t+2}. The base model (every non-``mtp.*`` tensor,
including the shared ``embed_tokens`` and ``lm_head``) stays FROZEN and is written back byte for
byte: the drafts are verified against the base, so the base's outputs must not move, and the
evaluation service's references for this checkpoint stay valid.

The base is rebuilt as transformers' ``Qwen3NextForCausalLM`` by inverting
``qwen3_next.sglang_weights`` (the experts re-fused into ``[E, 2I, H]`` / ``[E, H, I]``), runs in
bf16 as SGLang does, and must reproduce its held-out loss. The MTP layer is built from
transformers' own modules (``Qwen3NextDecoderLayer`` of a one-layer full-attention config, its
rotary embedding, ``Qwen3NextRMSNorm`` = Gemma's zero-centred norm) in fp32, initialised from the
shipped ``mtp.*``, trained with AdamW on random windows of the committed corpus (same
tokenisation and 98/2 split as the base), one thread, fixed seeds: the same inputs give the same
weights. The trained tensors are written back in SGLang's names (experts unfused, bf16) into
``OUT/model.safetensors`` (default: MODEL itself), and ``training.json`` gets an ``mtp`` entry with
the held-out MTP loss and the top-1 agreement of the MTP's argmax with the base's own greedy
next-next token (what greedy speculative decoding accepts).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRMSNorm,
    Qwen3NextRotaryEmbedding,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_next import ROOT, TOKENIZER, corpus, make_config

DEFAULT_MODEL = ROOT / "evalsvc" / "assets" / "sglang-models" / "qwen3-next-tiny"


def to_transformers(sg: dict[str, torch.Tensor], prefix: str, num_experts: int
                    ) -> dict[str, torch.Tensor]:
    """The inverse of ``sglang_weights`` for the tensors under ``prefix`` (SGLang names, prefix
    stripped): per-expert ``gate_proj``/``up_proj``/``down_proj`` re-fused into transformers'
    ``experts.gate_up_proj`` [E, 2I, H] (gate first) and ``experts.down_proj`` [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in sg.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(head, {}).setdefault(int(e), {})[proj] = v
        else:
            out[name] = v
    for head, per in experts.items():
        assert sorted(per) == list(range(num_experts)), (head, sorted(per))
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]], 0) for e in range(num_experts)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack(
            [per[e]["down_proj"] for e in range(num_experts)])
    return out


def to_sglang(sd: dict[str, torch.Tensor], prefix: str, inter: int) -> dict[str, torch.Tensor]:
    """transformers names (fused experts) -> SGLang names under ``prefix`` (experts unfused)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            head = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                gate, up = v[e].split(inter, 0)
                out[f"{prefix}{head}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{head}{e}.up_proj.weight"] = up.contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            head = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}{head}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[prefix + k] = v.contiguous()
    return out


class MTP(nn.Module):
    """SGLang's Qwen3NextForCausalLMMTP draft computation (embedding and lm_head passed in)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        mcfg = copy.deepcopy(cfg)
        mcfg.num_hidden_layers = 1
        mcfg.layer_types = ["full_attention"]
        mcfg._attn_implementation = "sdpa"  # attention_mask=None -> causal
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(hidden, eps)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(mcfg, 0)])
        self.norm = Qwen3NextRMSNorm(hidden, eps)
        self.rotary_emb = Qwen3NextRotaryEmbedding(config=mcfg)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb_next [B, T, H] = embed(x_{t+1}), hidden [B, T, H] = h_t; returns mtp.norm(z)."""
        z = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next),
                               self.pre_fc_norm_hidden(hidden)], -1))
        pos = torch.arange(z.shape[1]).unsqueeze(0)
        pe = self.rotary_emb(z, pos)
        for layer in self.layers:
            z = layer(z, position_embeddings=pe, attention_mask=None, position_ids=pos)
        return self.norm(z)


def batch_from(src: torch.Tensor, n: int, seq: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(src) - seq - 1, (n,), generator=g)
    return torch.stack([src[s: s + seq] for s in starts.tolist()])


@torch.no_grad()
def base_pass(base: Qwen3NextForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen base on x: (final-normed hidden states fp32, logits fp32)."""
    h = base.model(input_ids=x).last_hidden_state
    return h.float(), base.lm_head(h).float()


def mtp_logits(mtp: MTP, base: Qwen3NextForCausalLM, x: torch.Tensor, h: torch.Tensor
               ) -> torch.Tensor:
    """MTP logits at draft positions t = 0..T-2 (from h_t and x_{t+1}), predicting x_{t+2}."""
    emb = base.model.embed_tokens(x[:, 1:]).float()
    out = mtp(emb, h[:, :-1])
    return out @ base.lm_head.weight.float().t()


@torch.no_grad()
def evaluate(mtp: MTP, base: Qwen3NextForCausalLM, held: torch.Tensor, seq: int
             ) -> dict[str, float]:
    """Held-out MTP cross-entropy against x_{t+2} and top-1 agreement with the base's greedy
    next-next token (argmax of the base's logits at t+1), on 32 fixed windows."""
    x = batch_from(held, 32, seq, torch.Generator().manual_seed(0))
    h, base_logits = base_pass(base, x)
    logits = mtp_logits(mtp, base, x, h)[:, :-1]  # t = 0..T-3: targets x_{t+2} exist
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))
    agree = (logits.argmax(-1) == base_logits[:, 1:-1].argmax(-1)).float().mean()
    base_loss = nn.functional.cross_entropy(base_logits[:, :-1].reshape(-1, logits.shape[-1]),
                                            x[:, 1:].reshape(-1))
    return {"loss": round(loss.item(), 4), "agree": round(agree.item(), 4),
            "base_loss": round(base_loss.item(), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path, nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: MODEL)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    out_dir = args.out or args.model
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    cfg = make_config(tok)
    shipped = json.loads((args.model / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_experts", "moe_intermediate_size",
                "vocab_size", "layer_types", "rms_norm_eps", "partial_rotary_factor"):
        assert getattr(cfg, key) == shipped[key], key
    sg = load_file(args.model / "model.safetensors")

    # the frozen base, bf16 as SGLang runs it
    base = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    base_sd = to_transformers({k: v for k, v in sg.items() if not k.startswith("mtp.")}, "",
                              cfg.num_experts)
    base.load_state_dict(base_sd, strict=True)
    base.eval().requires_grad_(False)

    mtp = MTP(cfg)
    mtp_sd = to_transformers(sg, "mtp.", cfg.num_experts)
    missing, unexpected = mtp.load_state_dict({k: v.float() for k, v in mtp_sd.items()},
                                              strict=False)
    # only the rotary embedding's non-learnt buffers may lack a checkpoint counterpart
    assert not unexpected and all(k.startswith("rotary_emb.") for k in missing), (missing,
                                                                                  unexpected)

    source, held = corpus(tok)
    before = evaluate(mtp, base, held, args.seq)
    print(f"held-out: base loss {before['base_loss']}  MTP loss {before['loss']}  "
          f"top-1 agreement {before['agree']}", flush=True)
    assert before["base_loss"] < 3.6, "the base did not load as trained"

    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(args.seed)
    warm = min(30, args.steps)
    t0 = time.time()
    mtp.train()
    for step in range(args.steps):
        frac = (step - warm) / max(1, args.steps - warm)
        for group in opt.param_groups:
            group["lr"] = (args.lr * (step + 1) / warm if step < warm
                           else args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac))))
        x = batch_from(source, args.batch, args.seq, gen)
        h, _ = base_pass(base, x)
        logits = mtp_logits(mtp, base, x, h)[:, :-1]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           x[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s", flush=True)
    seconds = round(time.time() - t0, 1)
    mtp.eval()
    after = evaluate(mtp, base, held, args.seq)
    print(f"held-out after: MTP loss {after['loss']}  top-1 agreement {after['agree']}",
          flush=True)

    # back to SGLang names, bf16; every non-mtp tensor is the loaded one, untouched
    trained = to_sglang({k: v.detach().to(torch.bfloat16) for k, v in mtp.state_dict().items()
                         if not k.startswith("rotary_emb.")}, "mtp.", cfg.moe_intermediate_size)
    assert set(trained) == {k for k in sg if k.startswith("mtp.")}, \
        set(trained) ^ {k for k in sg if k.startswith("mtp.")}
    for k, v in trained.items():
        assert v.shape == sg[k].shape and v.dtype == sg[k].dtype, k
    new = {k: (trained[k] if k.startswith("mtp.") else v) for k, v in sg.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(new, out_dir / "model.safetensors", metadata={"format": "pt"})

    info_path = (out_dir if (out_dir / "training.json").exists() else args.model) / "training.json"
    info = json.loads(info_path.read_text())
    info["mtp"] = {
        "script": "training/qwen3_next_mtp.py",
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("model", "out")},
        "steps": args.steps,
        "held_out_mtp_loss_nats_before": before["loss"],
        "held_out_mtp_loss_nats": after["loss"],
        "held_out_top1_agreement_before": before["agree"],
        "held_out_top1_agreement": after["agree"],
        "train_seconds": seconds,
    }
    (out_dir / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved {out_dir}: {info['mtp']}", flush=True)


if __name__ == "__main__":
    main()
