"""Device-side pools of the embedded engine: KV tokens, recurrent-state slots, and the host tier.

As in SGLang, allocation never clears memory: a slot handed out again still holds whatever its last
owner left there. Clearing is an explicit operation (``clear_slots``) that the scheduler records and
the forward pass executes.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable

import torch

from .model import HybridLM


class OutOfMemory(RuntimeError):
    pass


def pool_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` for a pool, in anonymous memory that the kernel fills
    with zeros page by page as it is first touched, rather than all at once: a KV pool of the
    default 65,536 tokens is 128 MiB, most of which a run never touches, and zeroing it took about
    45 ms of every engine start (and that memory). The same zeros either way."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class FreeList:
    """Indices 1..size (0 is a padding index that is never handed out)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def clear(self) -> None:
        self._free = list(range(self.size, 0, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfMemory(f"asked for {n}, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        return out

    def free(self, idx: Iterable[int]) -> None:
        self._free.extend(int(i) for i in idx)


class KVPool:
    """Per-token K and V of every attention layer: ``k[layer]`` is [size + 1, heads, head_dim]."""

    def __init__(self, model: HybridLM, size: int) -> None:
        cfg = model.cfg
        n = len(cfg.attention_layers)
        shape = (size + 1, cfg.num_attention_heads, cfg.head_dim)
        dtype = model.numerics.dtype  # SGLang's KV cache dtype "auto": the model's
        self.k = [pool_zeros(*shape, dtype=dtype) for _ in range(n)]
        self.v = [pool_zeros(*shape, dtype=dtype) for _ in range(n)]
        self.slots = FreeList(size)

    def access(self, past: list[torch.Tensor], new: list[torch.Tensor]) -> PoolKV:
        return PoolKV(self, past, new)

    def bytes_per_token(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.k + self.v)


class PoolKV:
    """:class:`~.model.KVAccess` over the pool: new keys go to their token slots, then each
    segment's keys are read back through its index row (one gather per layer)."""

    def __init__(self, pool: KVPool, past: list[torch.Tensor], new: list[torch.Tensor]) -> None:
        self.pool = pool
        self.past, self.new = past, new
        self.past_lens = [len(p) for p in past]
        self.new_idx = torch.cat(new)
        rows = [torch.cat([p, n]) for p, n in zip(past, new, strict=True)]
        width = max(len(r) for r in rows)
        self.rows = torch.zeros(len(rows), width, dtype=torch.long)  # 0: a padding slot
        for b, r in enumerate(rows):
            self.rows[b, : len(r)] = r

    def step(self, b: int, t: int) -> PoolKV:
        return PoolKV(self.pool, [torch.cat([self.past[b], self.new[b][:t]])],
                      [self.new[b][t: t + 1]])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp[self.new_idx] = k
        vp[self.new_idx] = v
        flat = self.rows.flatten()
        shape = (*self.rows.shape, *kp.shape[1:])
        return kp.index_select(0, flat).view(shape), vp.index_select(0, flat).view(shape)


class StatePool:
    """Recurrent states in ``size`` slots: the target's, and the MTP head's (draft state).

    ``conv[i]``/``ssm[i]`` hold recurrent layer i of the target; ``draft_conv``/``draft_ssm`` the
    MTP head's block and ``draft_hidden`` the target hidden state the next draft step starts from.
    Conv states and hidden states are kept in the model's dtype, ssm states in
    ``--mamba-ssm-dtype``.
    """

    def __init__(self, model: HybridLM, size: int, with_draft: bool) -> None:
        self.size = size
        self.conv, self.ssm = [], []
        dtype, ssm_dtype = model.numerics.dtype, model.numerics.ssm_dtype
        for mixer in model.recurrent_mixers():
            conv_shape, ssm_shape = mixer.state_shapes()
            self.conv.append(torch.zeros(size + 1, *conv_shape, dtype=dtype))
            self.ssm.append(torch.zeros(size + 1, *ssm_shape, dtype=ssm_dtype))
        self.with_draft = with_draft
        if with_draft:
            conv_shape, ssm_shape = model.mtp.block.mixer.state_shapes()
            self.draft_conv = torch.zeros(size + 1, *conv_shape, dtype=dtype)
            self.draft_ssm = torch.zeros(size + 1, *ssm_shape, dtype=ssm_dtype)
            self.draft_hidden = torch.zeros(size + 1, model.cfg.hidden_size, dtype=dtype)
        self.slots = FreeList(size)

    def target_tensors(self) -> list[torch.Tensor]:
        return self.conv + self.ssm

    def draft_tensors(self) -> list[torch.Tensor]:
        if not self.with_draft:
            return []
        return [self.draft_conv, self.draft_ssm, self.draft_hidden]

    def clear_slots(self, idx: list[int], draft_only: bool = False) -> None:
        if not idx:
            return
        tensors = self.draft_tensors() if draft_only else self.target_tensors() + self.draft_tensors()
        for t in tensors:
            t[idx] = 0.0

    def copy_from(self, src: list[int], dst: list[int], draft_only: bool = False) -> None:
        if not src:
            return
        tensors = self.draft_tensors() if draft_only else self.target_tensors() + self.draft_tensors()
        for t in tensors:
            t[dst] = t[src]

    def read(self, slot: int) -> list[torch.Tensor]:
        return [t[slot].clone() for t in self.target_tensors() + self.draft_tensors()]

    def write(self, slot: int, values: list[torch.Tensor]) -> None:
        for t, v in zip(self.target_tensors() + self.draft_tensors(), values, strict=True):
            t[slot] = v

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size()
                   for t in self.target_tensors() + self.draft_tensors())


class HostPool:
    """The host-memory tier: copies of KV tokens and state slots evicted from (or written through
    from) the device pools. Plain tensors in CPU memory, indexed like the device pools."""

    def __init__(self, kv: KVPool, states: StatePool, tokens: int, slots: int) -> None:
        self.k = [pool_zeros(tokens + 1, *t.shape[1:], dtype=t.dtype) for t in kv.k]
        self.v = [pool_zeros(tokens + 1, *t.shape[1:], dtype=t.dtype) for t in kv.v]
        self.state = [torch.zeros(slots + 1, *t.shape[1:], dtype=t.dtype)
                      for t in states.target_tensors() + states.draft_tensors()]
        self.token_slots = FreeList(tokens)
        self.state_slots = FreeList(slots)

    def backup_kv(self, kv: KVPool, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        for layer in range(len(self.k)):
            self.k[layer][host_idx] = kv.k[layer][device_idx]
            self.v[layer][host_idx] = kv.v[layer][device_idx]

    def load_kv(self, kv: KVPool, host_idx: torch.Tensor, device_idx: torch.Tensor) -> None:
        for layer in range(len(self.k)):
            kv.k[layer][device_idx] = self.k[layer][host_idx]
            kv.v[layer][device_idx] = self.v[layer][host_idx]

    def backup_state(self, states: StatePool, device_slot: int, host_slot: int) -> None:
        for host, dev in zip(self.state, states.target_tensors() + states.draft_tensors(),
                             strict=True):
            host[host_slot] = dev[device_slot]

    def load_state(self, states: StatePool, host_slot: int, device_slot: int) -> None:
        for host, dev in zip(self.state, states.target_tensors() + states.draft_tensors(),
                             strict=True):
            dev[device_slot] = host[host_slot]
