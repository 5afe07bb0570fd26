"""Run under the SGLang CPU environment's python: SGLang's CPU kernel's causal conv1d
(``sgl_kernel``'s ``causal_conv1d_fwd_cpu``, as SGLang 0.5.17's gated-deltanet backend calls it on
``--device cpu``) over a sequence at once, and over its prefix and then the rest from the conv state
the prefix left, in SGLang's own CPU layout of the conv-state pool. Prints, as JSON, whether that
state holds the prefix's last width-1 tokens and, per position of the rest, the largest difference
from the one-pass result (0 where the split computes what the one pass does) and from the rest
convolved from a zero state (0 where the kernel ignores the state it was given)."""

import json

import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
import torch
from sglang.srt.layers.amx_utils import _init_amx_conv_state

torch.manual_seed(0)
DIM, WIDTH, PREFIX, REST = 256, 4, 20, 12
weight = torch.randn(DIM, WIDTH, dtype=torch.bfloat16)
tokens = torch.randn(PREFIX + REST, DIM, dtype=torch.bfloat16)


def pool() -> torch.Tensor:
    """One layer's conv states as SGLang allocates them on CPU: (slots, dim, width-1)."""
    return _init_amx_conv_state([torch.zeros((1, 2, DIM, WIDTH - 1), dtype=torch.bfloat16)])[0][0]


def conv(x: torch.Tensor, states: torch.Tensor, initial: bool) -> torch.Tensor:
    xt = x.clone().transpose(0, 1)  # (dim, tokens), as the backend passes it
    out = torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(
        xt, weight, None, states, torch.tensor([0, x.shape[0]], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), torch.tensor([initial]), True, -1, True)
    return (xt if out is None else out).transpose(0, 1).float()


once = conv(tokens, pool(), False)
states = pool()
conv(tokens[:PREFIX], states, False)
held = bool(torch.equal(states[0].float(), tokens[PREFIX - WIDTH + 1:PREFIX].t().float()))
split = conv(tokens[PREFIX:], states, True)
diff = (split - once[PREFIX:]).abs().max(dim=1).values
zero = (split - conv(tokens[PREFIX:], pool(), False)).abs().max(dim=1).values
print(json.dumps({"width": WIDTH, "state_holds_prefix_tail": held,
                  "max_difference_per_position": [float(d) for d in diff],
                  "max_difference_from_zero_state": [float(d) for d in zero]}))
