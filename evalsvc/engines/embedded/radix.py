"""Radix prefix tree over token ids with recurrent-state snapshots, as SGLang keeps for hybrid models.

Every node holds the KV-pool indices of its key's tokens (``value``) and, optionally, a state slot
(``mamba``) holding the recurrent state after the last token of its path. A prefix match can only end
at a node that has a state (on the device, or on the host tier), because a request cannot resume a
recurrent layer from anywhere else. Eviction is least-recently-used over unlocked leaves for KV, and
over unlocked nodes for states (an internal node loses its state and becomes a tombstone).

The tree only does bookkeeping: it frees and allocates indices, and asks its ``owner`` to copy data to
the host tier, but never touches pool memory itself.

With a page size above 1 the tree holds whole pages, as SGLang's: a match considers the key's
page-aligned part only, and what is inserted is page-aligned (the scheduler's snapshot positions
always are).

Requests that carry an ``extra_key`` or ``cache_salt`` (SGLang's cache namespaces) match and insert
under a root of their namespace: they share cached prefixes only with requests of the same one.
Eviction is over all namespaces together.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch


class TreeOwner(Protocol):
    def free_kv(self, idx: torch.Tensor) -> None: ...
    def free_state(self, slot: int) -> None: ...
    def backup_node(self, node: TreeNode) -> bool: ...
    def free_host(self, node: TreeNode) -> None: ...


_ids = itertools.count(1)


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    value: torch.Tensor | None = None  # device KV indices (None: evicted to host)
    mamba: int | None = None  # device state slot
    host_value: torch.Tensor | None = None
    host_mamba: int | None = None
    lock_ref: int = 0
    mamba_lock: int = 0
    last_access: int = 0
    hit_count: int = 0
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def has_state(self) -> bool:
        return self.mamba is not None or self.host_mamba is not None


@dataclass
class MatchResult:
    length: int  # matched tokens; the match ends where a state exists
    node: TreeNode  # the node the match ends at (the root when nothing matched)
    path: list[TreeNode]  # nodes from the root's child down to ``node``
    host_tokens: int  # matched tokens whose KV is only on the host tier

    def device_indices(self) -> torch.Tensor:
        parts = [n.value for n in self.path]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class RadixCache:
    def __init__(self, owner: TreeOwner, write_policy: str | None = None,
                 page_size: int = 1) -> None:
        self.owner = owner
        self.write_policy = write_policy  # None: no host tier
        self.page_size = page_size
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.roots: dict[Hashable, TreeNode] = {}
        self.root = self.root_of(None)

    def root_of(self, namespace: Hashable) -> TreeNode:
        """The root of a cache namespace (None: the shared one)."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TreeNode(value=torch.zeros(0, dtype=torch.long))
            root.lock_ref = 1
        return root

    # ---- matching -------------------------------------------------------------------------
    def match_prefix(self, key: list[int], namespace: Hashable = None) -> MatchResult:
        root = self.root_of(namespace)
        key = key[: len(key) // self.page_size * self.page_size]
        node, pos, path = root, 0, []
        best = MatchResult(0, root, [], 0)
        now = next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common(child.key, key[pos:])
            if n < len(child.key):
                break
            child.last_access = now
            node, pos = child, pos + n
            path.append(child)
            if node.has_state:
                host = sum(len(p.key) for p in path if not p.on_device)
                best = MatchResult(pos, node, list(path), host)
        if best.length:
            best.node.hit_count += 1
            if self.write_policy == "write_through_selective":
                self._backup_path(best.path)
        return best

    # ---- locking --------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        node.mamba_lock += 1
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        node.mamba_lock -= 1
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    # ---- insertion ------------------------------------------------------------------------
    def insert(self, key: list[int], value: torch.Tensor, mamba: int | None, protected: int = 0,
               namespace: Hashable = None):
        """Insert ``key`` with its KV indices and the state after its last token.

        ``value[:protected]`` are indices the tree already owns (the caller's matched prefix).
        Returns (node at the end of key, duplicate KV indices the caller must free, whether the
        tree took ``mamba``: if the node already had a state the caller keeps ownership of it).
        """
        assert len(key) == len(value)
        assert len(key) % self.page_size == 0, f"insert of {len(key)} tokens, page {self.page_size}"
        root = self.root_of(namespace)
        node, pos, dup, created = root, 0, [], []
        now = next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key=list(key[pos:]), parent=node, value=value[pos:].clone(),
                                last_access=now)
                node.children[key[pos]] = leaf
                created.append(leaf)
                node, pos = leaf, len(key)
                break
            n = _common(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if child.on_device:
                if pos + n > protected:
                    dup.append(value[max(pos, protected): pos + n])
            else:  # evicted to the host: the caller's fresh KV becomes the device copy
                child.value = value[pos: pos + n].clone()
            node, pos = child, pos + n
        took = False
        if mamba is not None and node is not root and node.mamba is None:
            node.mamba = mamba
            took = True
            if node not in created:
                created.append(node)
        if self.write_policy == "write_through":
            self._backup_path(created)
        dup_idx = torch.cat(dup) if dup else torch.zeros(0, dtype=torch.long)
        return node, dup_idx, took

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after n tokens; the new upper node has no state (a tombstone)."""
        parent = child.parent
        upper = TreeNode(key=child.key[:n], parent=parent, last_access=child.last_access,
                         lock_ref=child.lock_ref, hit_count=child.hit_count)
        if child.value is not None:
            upper.value, child.value = child.value[:n], child.value[n:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _backup_path(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            needs = (node.on_device and node.host_value is None) or (
                node.mamba is not None and node.host_mamba is None)
            if needs and not self.owner.backup_node(node):
                return

    # ---- eviction -------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:  # not a root
                yield node

    def evictable_tokens(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.on_device and n.lock_ref == 0)

    def evictable_states(self) -> int:
        return sum(1 for n in self._nodes() if n.mamba is not None and n.mamba_lock == 0)

    def total_states(self) -> int:
        return sum(1 for n in self._nodes() if n.mamba is not None)

    def total_tokens(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.on_device)

    def evict_tokens(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device KV tokens from unlocked device leaves (LRU)."""
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._device_leaf(node):
                continue
            freed += len(node.key)
            parent = node.parent
            self._evict_device(node)
            if parent.parent is not None and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def evict_states(self, num_slots: int) -> int:
        """Free at least ``num_slots`` device state slots (LRU); leaves go whole."""
        heap = [(n.last_access, n.id, n) for n in self._nodes()
                if n.mamba is not None and n.mamba_lock == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            if node.mamba is None:
                continue
            freed += 1
            if self._device_leaf(node):
                self._evict_device(node)
            else:
                self._drop_state(node)
        return freed

    def _device_leaf(self, node: TreeNode) -> bool:
        return (node.on_device and node.lock_ref == 0
                and not any(c.on_device for c in node.children.values()))

    def _drop_state(self, node: TreeNode) -> None:
        if node.host_mamba is None and self.write_policy == "write_back":
            self.owner.backup_node(node)
        self.owner.free_state(node.mamba)
        node.mamba = None

    def _evict_device(self, node: TreeNode) -> None:
        if self.write_policy == "write_back" and node.host_value is None:
            self.owner.backup_node(node)
        self.owner.free_kv(node.value)
        if node.mamba is not None:
            self.owner.free_state(node.mamba)
        node.value, node.mamba = None, None
        if node.host_value is None and not node.children:
            self._delete(node)

    def evict_host(self, num_tokens: int = 0, num_states: int = 0) -> None:
        """Drop host-only leaves (LRU) until the host tier has the asked room back."""
        freed_t = freed_s = 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._host_leaf(n)]
        heapq.heapify(heap)
        while (freed_t < num_tokens or freed_s < num_states) and heap:
            _, _, node = heapq.heappop(heap)
            if not self._host_leaf(node):
                continue
            freed_t += len(node.key)
            freed_s += node.host_mamba is not None
            parent = node.parent
            self.owner.free_host(node)
            self._delete(node)
            if parent.parent is not None and self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _host_leaf(self, node: TreeNode) -> bool:
        return (not node.on_device and node.host_value is not None and not node.children
                and node.lock_ref == 0)

    def _delete(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[node.key[0]]
        node.parent = None


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
