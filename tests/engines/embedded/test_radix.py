"""The radix prefix tree with recurrent-state snapshots (evalsvc/engines/embedded/radix.py)."""

from __future__ import annotations

import pytest
import torch

from evalsvc.engines.embedded.radix import RadixCache, TreeNode


class FakeOwner:
    """Records what the tree frees and backs up; backs up by handing out fake host indices."""

    def __init__(self, backup_ok: bool = True) -> None:
        self.backup_ok = backup_ok
        self.freed_kv: list[int] = []
        self.freed_states: list[int] = []
        self.backups: list[TreeNode] = []
        self.freed_host: list[TreeNode] = []
        self._next_host = 1000

    def free_kv(self, idx: torch.Tensor) -> None:
        self.freed_kv.extend(idx.tolist())

    def free_state(self, slot: int) -> None:
        self.freed_states.append(slot)

    def backup_node(self, node: TreeNode) -> bool:
        self.backups.append(node)
        if not self.backup_ok:
            return False
        if node.on_device and node.host_value is None:
            n = len(node.key)
            node.host_value = torch.arange(self._next_host, self._next_host + n)
            self._next_host += n
        if node.mamba is not None and node.host_mamba is None:
            node.host_mamba = self._next_host
            self._next_host += 1
        return True

    def free_host(self, node: TreeNode) -> None:
        self.freed_host.append(node)
        node.host_value, node.host_mamba = None, None


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def kv(key: list[int], base: int = 0) -> torch.Tensor:
    """Distinct fake KV indices for a key: base + position."""
    return torch.arange(base, base + len(key))


@pytest.fixture
def owner() -> FakeOwner:
    return FakeOwner()


@pytest.fixture
def tree(owner) -> RadixCache:
    return RadixCache(owner)


def nodes_of(tree: RadixCache) -> list[TreeNode]:
    return list(tree._nodes())


# ---- matching ----------------------------------------------------------------------------------
def test_match_on_empty_tree(tree):
    m = tree.match_prefix([1, 2, 3])
    assert m.length == 0
    assert m.node is tree.root
    assert m.path == []
    assert m.host_tokens == 0
    assert m.device_indices().tolist() == []
    assert tree.match_prefix([]).length == 0


def test_insert_then_match(tree):
    key = [5, 6, 7, 8]
    node, dup, took = tree.insert(key, kv(key, 10), mamba=3)
    assert took is True
    assert dup.tolist() == []
    assert node.mamba == 3
    m = tree.match_prefix([*key, 9, 9])
    assert m.length == 4
    assert m.node is node
    assert m.host_tokens == 0
    assert m.device_indices().tolist() == [10, 11, 12, 13]
    assert node.hit_count == 1
    assert tree.match_prefix([6, 7]).length == 0


def test_match_ends_only_at_a_node_with_state(tree):
    tree.insert([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5], 10), mamba=None)
    assert tree.match_prefix([1, 2, 3, 4, 5]).length == 0  # KV without a state: useless
    node, dup, took = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=7, protected=0)
    assert took is True
    assert dup.tolist() == [10, 11, 12]  # the tree already held these tokens' KV
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.length == 3
    assert m.node is node and node.mamba == 7
    assert m.device_indices().tolist() == [10, 11, 12]


def test_partial_edge_match_does_not_count(tree):
    tree.insert([1, 2, 3, 4], kv([1, 2, 3, 4]), mamba=1)
    assert tree.match_prefix([1, 2, 3]).length == 0
    assert tree.match_prefix([1, 2, 3, 5]).length == 0
    assert tree.match_prefix([1, 2, 3, 4]).length == 4


def test_match_stops_at_deepest_state_on_the_path(tree):
    tree.insert([1, 2], kv([1, 2], 10), mamba=1)
    tree.insert([1, 2, 3, 4, 5, 6], idx(10, 11, 20, 21, 22, 23), mamba=2, protected=2)
    m = tree.match_prefix([1, 2, 3, 4, 5, 9])  # diverges inside the second node
    assert m.length == 2
    assert m.node.mamba == 1
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.length == 6
    assert [n.mamba for n in m.path] == [1, 2]
    assert m.device_indices().tolist() == [10, 11, 20, 21, 22, 23]


# ---- insertion ---------------------------------------------------------------------------------
def test_insert_inside_existing_node_splits_it(tree):
    key = [1, 2, 3, 4, 5]
    lower, _, _ = tree.insert(key, idx(10, 11, 12, 13, 14), mamba=9)
    upper, dup, took = tree.insert([1, 2], idx(10, 11), mamba=None, protected=2)
    assert took is False
    assert dup.tolist() == []  # all protected
    assert upper is not lower
    assert upper.key == [1, 2] and upper.mamba is None  # tombstone
    assert upper.value.tolist() == [10, 11]
    assert lower.key == [3, 4, 5] and lower.mamba == 9
    assert lower.value.tolist() == [12, 13, 14]
    assert lower.parent is upper and upper.parent is tree.root
    assert upper.children == {3: lower}
    assert tree.root.children == {1: upper}
    assert tree.match_prefix([1, 2]).length == 0
    m = tree.match_prefix(key)
    assert m.length == 5
    assert m.path == [upper, lower]
    assert m.device_indices().tolist() == [10, 11, 12, 13, 14]
    assert tree.total_tokens() == 5
    assert tree.total_states() == 1


def test_insert_diverging_key_splits_and_branches(tree):
    tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=1)
    leaf, dup, took = tree.insert([1, 2, 7, 8], idx(10, 11, 30, 31), mamba=2, protected=2)
    assert took is True
    assert dup.tolist() == []
    assert leaf.key == [7, 8]
    assert leaf.value.tolist() == [30, 31]
    upper = leaf.parent
    assert upper.key == [1, 2] and upper.mamba is None
    assert sorted(upper.children) == [3, 7]
    assert tree.match_prefix([1, 2, 3, 4]).device_indices().tolist() == [10, 11, 12, 13]
    assert tree.match_prefix([1, 2, 7, 8]).device_indices().tolist() == [10, 11, 30, 31]
    assert tree.total_tokens() == 6


def test_reinsert_returns_duplicates_beyond_protected(tree):
    key = [1, 2, 3, 4]
    tree.insert(key, idx(10, 11, 12, 13), mamba=5)
    node, dup, took = tree.insert(key, idx(10, 11, 42, 43), mamba=6, protected=2)
    assert dup.tolist() == [42, 43]
    assert took is False  # the node keeps its state; the caller still owns slot 6
    assert node.mamba == 5
    assert node.value.tolist() == [10, 11, 12, 13]
    _, dup, _ = tree.insert(key, idx(40, 41, 42, 43), mamba=None)
    assert dup.tolist() == [40, 41, 42, 43]


def test_extend_matched_prefix_with_protected(tree):
    tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    leaf, dup, took = tree.insert([1, 2, 3, 4, 5], idx(10, 11, 12, 20, 21), mamba=2, protected=3)
    assert dup.tolist() == []
    assert took is True
    assert leaf.key == [4, 5] and leaf.value.tolist() == [20, 21]


def test_reinsert_into_tombstone_takes_state(tree):
    tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=1)
    tree.insert([1, 2], idx(10, 11), mamba=None, protected=2)  # tombstone [1, 2]
    node, dup, took = tree.insert([1, 2], idx(50, 51), mamba=8)
    assert took is True
    assert node.mamba == 8
    assert dup.tolist() == [50, 51]
    assert node.value.tolist() == [10, 11]
    assert tree.match_prefix([1, 2, 9]).length == 2


def test_insert_does_not_give_the_root_a_state(tree):
    node, dup, took = tree.insert([], idx(), mamba=4)
    assert node is tree.root
    assert dup.tolist() == []
    assert took is False
    assert tree.root.mamba is None


# ---- locking and eviction ---------------------------------------------------------------------------
def test_lock_protects_from_evict_tokens(tree, owner):
    tree.insert([1, 2], idx(10, 11), mamba=1)
    leaf, _, _ = tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=2, protected=2)
    tree.lock(leaf)
    assert leaf.lock_ref == 1 and leaf.parent.lock_ref == 1 and leaf.mamba_lock == 1
    assert tree.evictable_tokens() == 0
    assert tree.evictable_states() == 1  # the parent's state is not locked
    assert tree.evict_tokens(10) == 0
    assert owner.freed_kv == []
    tree.unlock(leaf)
    assert leaf.lock_ref == 0 and leaf.mamba_lock == 0 and tree.root.lock_ref == 1
    assert tree.evictable_tokens() == 4
    assert tree.evict_tokens(10) == 4
    assert sorted(owner.freed_kv) == [10, 11, 12, 13]
    assert sorted(owner.freed_states) == [1, 2]
    assert tree.root.children == {}


def test_evict_tokens_lru_order(tree, owner):
    a, _, _ = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    b, _, _ = tree.insert([4, 5, 6], idx(20, 21, 22), mamba=2)
    tree.match_prefix([1, 2, 3])  # touch a: b is now least recently used
    assert tree.evict_tokens(1) == 3
    assert owner.freed_kv == [20, 21, 22]
    assert owner.freed_states == [2]
    assert tree.match_prefix([4, 5, 6]).length == 0
    assert tree.match_prefix([1, 2, 3]).length == 3
    assert b.parent is None and tree.root.children == {1: a}


def test_evict_tokens_lru_order_without_touch(tree, owner):
    tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    tree.insert([4, 5, 6], idx(20, 21, 22), mamba=2)
    tree.evict_tokens(1)
    assert owner.freed_kv == [10, 11, 12]


def test_parent_becomes_evictable_leaf(tree, owner):
    tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=1)
    upper, _, _ = tree.insert([1, 2], idx(10, 11), mamba=2, protected=2)
    assert tree.evictable_tokens() == 4
    assert tree.evict_tokens(2) == 2
    assert owner.freed_kv == [12, 13]
    assert upper.children == {}
    assert tree.evictable_tokens() == 2
    assert tree.match_prefix([1, 2, 3, 4]).length == 2
    assert tree.evict_tokens(1) == 2
    assert owner.freed_kv == [12, 13, 10, 11]
    assert tree.root.children == {}
    assert tree.total_tokens() == 0


def test_evict_tokens_continues_into_parents_in_one_call(tree, owner):
    tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=1)
    tree.insert([1, 2], idx(10, 11), mamba=2, protected=2)
    assert tree.evict_tokens(3) == 4
    assert sorted(owner.freed_kv) == [10, 11, 12, 13]
    assert sorted(owner.freed_states) == [1, 2]
    assert tree.root.children == {}


def test_evict_states_tombstones_internal_node(tree, owner):
    upper, _, _ = tree.insert([1, 2], idx(10, 11), mamba=1)
    leaf, _, _ = tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=2, protected=2)
    tree.lock(leaf)  # the leaf's state is in use: only the parent's can go
    assert tree.evictable_states() == 1
    assert tree.evict_states(1) == 1
    assert owner.freed_states == [1]
    assert owner.freed_kv == []
    assert upper.mamba is None  # tombstone: KV and children kept
    assert upper.value.tolist() == [10, 11]
    assert upper.children == {3: leaf}
    assert tree.total_tokens() == 4
    assert tree.match_prefix([1, 2]).length == 0
    assert tree.match_prefix([1, 2, 3, 4]).length == 4
    assert tree.evict_states(1) == 0  # nothing unlocked left
    tree.unlock(leaf)


def test_evict_states_evicts_leaf_whole(tree, owner):
    tree.insert([1, 2], idx(10, 11), mamba=1)
    tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=2, protected=2)
    upper = tree.root.children[1]
    tree.lock(upper)
    assert tree.evict_states(1) == 1
    assert owner.freed_states == [2]
    assert owner.freed_kv == [12, 13]
    assert upper.children == {}
    assert upper.mamba == 1
    tree.unlock(upper)


def test_counts(tree):
    assert (tree.evictable_tokens(), tree.evictable_states(), tree.total_tokens(),
            tree.total_states()) == (0, 0, 0, 0)
    tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    tree.insert([1, 2, 3, 4, 5], idx(10, 11, 12, 13, 14), mamba=2, protected=3)
    tree.insert([7, 8], idx(20, 21), mamba=None)
    assert tree.total_tokens() == 7
    assert tree.total_states() == 2
    assert tree.evictable_tokens() == 7
    assert tree.evictable_states() == 2
    leaf = tree.match_prefix([1, 2, 3, 4, 5]).node
    tree.lock(leaf)
    assert tree.evictable_tokens() == 2  # only [7, 8]
    assert tree.evictable_states() == 1
    tree.unlock(leaf)
    assert tree.evictable_tokens() == 7


def test_reset_empties_tree(tree):
    tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    tree.insert([4], idx(20), mamba=2)
    tree.reset()
    assert tree.root.children == {}
    assert tree.root.lock_ref == 1
    assert tree.total_tokens() == 0 and tree.total_states() == 0
    assert tree.match_prefix([1, 2, 3]).length == 0


# ---- host tier ---------------------------------------------------------------------------------
def test_write_through_backs_up_new_nodes(owner):
    tree = RadixCache(owner, write_policy="write_through")
    a, _, _ = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    assert owner.backups == [a]
    assert a.host_value is not None and len(a.host_value) == 3
    assert a.host_mamba is not None
    b, _, _ = tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=2, protected=3)
    assert owner.backups == [a, b]
    tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=3, protected=4)  # nothing new
    assert owner.backups == [a, b]
    # eviction keeps backed-up nodes on the host without a new copy
    assert tree.evict_tokens(4) == 4
    assert owner.backups == [a, b]
    m = tree.match_prefix([1, 2, 3, 4])
    assert m.length == 4
    assert m.host_tokens == 4


def test_write_through_tombstone_taking_state_is_backed_up(owner):
    tree = RadixCache(owner, write_policy="write_through")
    tree.insert([1, 2, 3, 4], idx(10, 11, 12, 13), mamba=1)
    upper, _, took = tree.insert([1, 2], idx(10, 11), mamba=2, protected=2)
    assert took is True
    assert owner.backups[-1] is upper
    assert upper.host_mamba is not None
    assert len(upper.host_value) == 2  # split off the backed-up node's host copy


def test_write_back_eviction_keeps_host_only_node(owner):
    tree = RadixCache(owner, write_policy="write_back")
    node, _, _ = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    assert owner.backups == []  # nothing written until eviction
    assert tree.evict_tokens(3) == 3
    assert owner.backups == [node]
    assert owner.freed_kv == [10, 11, 12]
    assert owner.freed_states == [1]
    assert node.value is None and node.mamba is None
    assert node.host_value is not None and node.host_mamba is not None
    assert tree.root.children == {1: node}
    assert tree.total_tokens() == 0 and tree.total_states() == 0
    m = tree.match_prefix([1, 2, 3, 4])
    assert m.length == 3
    assert m.node is node
    assert m.host_tokens == 3


def test_write_back_host_tokens_counts_only_host_part(owner):
    tree = RadixCache(owner, write_policy="write_back")
    tree.insert([1, 2], idx(10, 11), mamba=1)
    leaf, _, _ = tree.insert([1, 2, 3, 4, 5], idx(10, 11, 12, 13, 14), mamba=2, protected=2)
    tree.match_prefix([1, 2])  # the parent is more recent than the leaf
    assert tree.evict_tokens(1) == 3
    assert owner.backups == [leaf]
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.length == 5
    assert m.host_tokens == 3
    assert tree.match_prefix([1, 2]).host_tokens == 0


def test_write_back_state_eviction_backs_up_state(owner):
    tree = RadixCache(owner, write_policy="write_back")
    upper, _, _ = tree.insert([1, 2], idx(10, 11), mamba=1)
    leaf, _, _ = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=2, protected=2)
    tree.lock(leaf)
    assert tree.evict_states(1) == 1
    assert owner.backups == [upper]
    assert upper.mamba is None and upper.host_mamba is not None
    assert upper.value.tolist() == [10, 11]  # KV stays on the device
    m = tree.match_prefix([1, 2])
    assert m.length == 2  # resumable from the host copy of the state
    assert m.host_tokens == 0
    tree.unlock(leaf)


def test_reinsert_over_host_only_node_restores_device_copy(owner):
    tree = RadixCache(owner, write_policy="write_back")
    node, _, _ = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    tree.evict_tokens(3)
    again, dup, took = tree.insert([1, 2, 3], idx(30, 31, 32), mamba=4)
    assert again is node
    assert dup.tolist() == []  # the caller's KV became the device copy
    assert took is True
    assert node.value.tolist() == [30, 31, 32]
    assert tree.match_prefix([1, 2, 3]).host_tokens == 0


def test_no_host_tier_evicted_leaf_is_deleted(tree, owner):
    node, _, _ = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    tree.evict_tokens(3)
    assert owner.backups == []
    assert node.parent is None
    assert tree.root.children == {}
    assert tree.match_prefix([1, 2, 3]).length == 0


def test_write_back_failed_backup_deletes_leaf():
    owner = FakeOwner(backup_ok=False)
    tree = RadixCache(owner, write_policy="write_back")
    tree.insert([1, 2, 3], idx(10, 11, 12), mamba=1)
    tree.evict_tokens(3)
    assert len(owner.backups) == 1
    assert tree.root.children == {}
    assert tree.match_prefix([1, 2, 3]).length == 0


def test_evict_host_deletes_host_only_leaves(owner):
    tree = RadixCache(owner, write_policy="write_back")
    a, _, _ = tree.insert([1, 2], idx(10, 11), mamba=1)
    b, _, _ = tree.insert([1, 2, 3], idx(10, 11, 12), mamba=2, protected=2)
    c, _, _ = tree.insert([7, 8], idx(20, 21), mamba=3)
    tree.evict_tokens(100)
    assert tree.total_tokens() == 0
    assert {n.id for n in nodes_of(tree)} == {a.id, b.id, c.id}
    tree.match_prefix([7, 8])  # c is the most recently used
    tree.evict_host(num_tokens=1)
    assert owner.freed_host == [b]  # the deepest, least recently used host-only leaf
    assert b.parent is None
    assert a.children == {}
    tree.evict_host(num_tokens=3)  # a becomes a host leaf, then c
    assert owner.freed_host == [b, a, c]
    assert tree.root.children == {}


def test_evict_host_counts_states(owner):
    tree = RadixCache(owner, write_policy="write_back")
    tree.insert([1], idx(10), mamba=1)
    tree.insert([2], idx(20), mamba=2)
    tree.evict_tokens(2)
    tree.evict_host(num_states=1)
    assert len(owner.freed_host) == 1
    assert len(tree.root.children) == 1


def test_evict_host_skips_device_nodes_and_locked(owner):
    tree = RadixCache(owner, write_policy="write_back")
    a, _, _ = tree.insert([1, 2], idx(10, 11), mamba=1)
    tree.evict_tokens(2)
    b, _, _ = tree.insert([5], idx(20), mamba=2)  # on the device
    tree.lock(a)
    tree.evict_host(num_tokens=10)
    assert owner.freed_host == []
    tree.unlock(a)
    tree.evict_host(num_tokens=10)
    assert owner.freed_host == [a]
    assert tree.root.children == {5: b}
