"""Radix prefix cache: a compressed token trie over whole pages.

Each node holds a token segment (a tuple, a multiple of ``page_size`` long) and the int32
slots of those tokens; the path from the root spells a cached prefix. Children are keyed by
their first page (their first token when ``page_size == 1``), so siblings never share one.
Example with ``page_size == 1`` after inserting [1,2,3,4], [1,2,3,8], [1,2,9]::

    root -- [1,2] -+- [3] -+- [4]
                   |       +- [8]
                   +- [9]

Slots are kept as numpy int32 arrays (an order of magnitude less overhead per call than small
torch ops on the host) and handed out as torch tensors.

Eviction candidates (unreferenced leaves) sit in a heap keyed by last access time, updated
incrementally with lazy invalidation: each node has at most one live entry, an entry whose
node was touched since it was pushed is re-pushed with the newer time when popped, and an
entry whose node is no longer an unreferenced leaf is dropped (the node is pushed again when
it becomes one). A parent is touched whenever a child is, so its time is never older.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from minisgl.kvcache.base import EMPTY_INDICES, BasePrefixCache, InsertResult, PrefixMatch

_NO_SLOTS = np.empty(0, dtype=np.int32)


class _Node:
    __slots__ = ("key", "value", "parent", "children", "ref", "last_access", "heap_seq")

    def __init__(self, key: tuple[int, ...], value: np.ndarray, parent: _Node | None) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[object, _Node] = {}
        self.ref = 0
        self.last_access = 0
        self.heap_seq = -1

    def __repr__(self) -> str:
        return f"_Node(tokens={len(self.key)}, ref={self.ref}, last_access={self.last_access})"


def _common_len(
    seg: tuple[int, ...], tokens: tuple[int, ...], pos: int, limit: int, ps: int
) -> int:
    """Longest page-aligned ``m`` with ``seg[:m] == tokens[pos:pos + m]`` and ``pos + m <= limit``,
    given that the first page already matches. O(m) token comparisons in O(log m) slices."""
    hi = min(len(seg), limit - pos)
    if seg[:hi] == tokens[pos : pos + hi]:
        return hi
    lo = ps
    while hi - lo > ps:
        mid = lo + (hi - lo) // (2 * ps) * ps
        if seg[lo:mid] == tokens[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _as_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    return token_ids if isinstance(token_ids, tuple) else tuple(token_ids)


class RadixPrefixCache(BasePrefixCache):
    """Compressed trie prefix cache with LRU eviction of unreferenced leaves.

    Costs: ``match_prefix`` / ``insert_prefix`` are O(prompt length) C-level comparisons plus
    O(path nodes) Python steps; lock/unlock O(path nodes); ``evict`` O(evicted nodes * log
    candidates). Nothing per request scans the tree.
    """

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._root = _Node((), _NO_SLOTS, None)
        self._evictable = 0
        self._protected = 0
        self._num_locks = 0
        self._clock = 0
        self._heap: list[tuple[int, int, _Node]] = []
        self._heap_counter = 0

    def _first_key(self, tokens: tuple[int, ...], pos: int) -> object:
        if self.page_size == 1:
            return tokens[pos]
        return tokens[pos : pos + self.page_size]

    # ---- match / insert ----------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        tokens = _as_tuple(token_ids)
        node, pos, values = self._walk(tokens, len(tokens) - len(tokens) % self.page_size)
        return PrefixMatch(handle=node, cached_len=pos, indices=_to_torch(values))

    def insert_prefix(
        self, token_ids: Sequence[int], indices: Sequence[int] | torch.Tensor | np.ndarray
    ) -> InsertResult:
        tokens = _as_tuple(token_ids)
        n = len(tokens) - len(tokens) % self.page_size
        mine = _to_numpy(indices)
        if mine.ndim != 1 or mine.shape[0] < n:
            raise ValueError(f"need {n} slot indices, got shape {mine.shape}")
        node, pos, values = self._walk(tokens, n)
        if pos < n:
            leaf = _Node(tokens[pos:n], mine[pos:n].copy(), node)
            leaf.last_access = self._clock
            node.children[self._first_key(tokens, pos)] = leaf
            self._evictable += n - pos
            self._push(leaf)
            values.append(leaf.value)
            node = leaf
        held = _to_torch(values)
        duplicates = EMPTY_INDICES
        if pos:
            own, cached = mine[:pos], held.numpy()[:pos]
            if own.tobytes() != cached.tobytes():
                duplicates = torch.from_numpy(own[own != cached])
        return InsertResult(handle=node, cached_len=n, indices=held, duplicates=duplicates)

    def _walk(self, tokens: tuple[int, ...], limit: int) -> tuple[_Node, int, list[np.ndarray]]:
        """Follow ``tokens[:limit]`` (page aligned) down the tree, splitting a node where the
        match ends inside it and touching every node on the way. Returns the deepest node
        reached, the matched length and the slot arrays along the path."""
        ps = self.page_size
        self._clock += 1
        now = self._clock
        node = self._root
        pos = 0
        values: list[np.ndarray] = []
        while pos < limit:
            child = node.children.get(self._first_key(tokens, pos))
            if child is None:
                break
            seg = child.key
            full = len(seg)
            if pos + full <= limit and tokens[pos : pos + full] == seg:
                m = full
            else:
                m = _common_len(seg, tokens, pos, limit, ps)
                child = self._split_at(child, m)
            child.last_access = now
            values.append(child.value)
            node = child
            pos += m
            if m < full:
                break
        return node, pos, values

    def _split_at(self, node: _Node, m: int) -> _Node:
        """Cut ``node`` after ``m`` tokens; the new upper part is returned and the original
        node keeps the tail, so handles to it still name the same prefix."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:m], node.value[:m], parent)
        upper.ref = node.ref
        upper.last_access = node.last_access
        parent.children[self._first_key(node.key, 0)] = upper
        node.key = node.key[m:]
        node.value = node.value[m:]
        node.parent = upper
        upper.children[self._first_key(node.key, 0)] = node
        return upper

    # ---- lock / unlock -----------------------------------------------------------------
    def lock_handle(self, handle: object) -> None:
        node = self._live(handle)
        while node is not self._root:
            if node.ref == 0:
                size = len(node.key)
                self._evictable -= size
                self._protected += size
            node.ref += 1
            node = node.parent
        self._root.ref += 1
        self._num_locks += 1

    def unlock_handle(self, handle: object) -> None:
        node = self._live(handle)
        if node.ref <= 0:
            raise ValueError("unlock_handle without a matching lock_handle")
        while node is not self._root:
            node.ref -= 1
            if node.ref == 0:
                size = len(node.key)
                self._protected -= size
                self._evictable += size
                if not node.children and node.heap_seq < 0:
                    self._push(node)
            node = node.parent
        self._root.ref -= 1
        self._num_locks -= 1

    def _live(self, handle: object) -> _Node:
        if not isinstance(handle, _Node):
            raise TypeError(f"not a RadixPrefixCache handle: {handle!r}")
        if handle is not self._root and handle.parent is None:
            raise ValueError("stale handle: its prefix was evicted before it was locked")
        return handle

    # ---- eviction ----------------------------------------------------------------------
    def _push(self, node: _Node) -> None:
        self._heap_counter += 1
        node.heap_seq = self._heap_counter
        heapq.heappush(self._heap, (node.last_access, self._heap_counter, node))

    def evict(self, num_tokens: int) -> torch.Tensor:
        heap = self._heap
        root = self._root
        freed: list[np.ndarray] = []
        done = 0
        while done < num_tokens and heap:
            stamp, seq, node = heapq.heappop(heap)
            if node.heap_seq != seq:
                continue
            node.heap_seq = -1
            if node.ref or node.children or node.parent is None:
                continue
            if stamp < node.last_access:
                self._push(node)
                continue
            parent = node.parent
            del parent.children[self._first_key(node.key, 0)]
            node.parent = None
            size = len(node.key)
            self._evictable -= size
            done += size
            freed.append(node.value)
            if parent is not root and parent.ref == 0 and not parent.children:
                if parent.heap_seq < 0:
                    self._push(parent)
        return _to_torch(freed)

    # ---- accounting and checks ---------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def tree(self) -> dict[tuple[int, ...], dict]:
        """The structure as nested dicts ``{segment: {child segment: ...}}``, for tests."""

        def build(node: _Node) -> dict[tuple[int, ...], dict]:
            return {c.key: build(c) for c in node.children.values()}

        return build(self._root)

    def _nodes(self) -> list[_Node]:
        out: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_indices(self) -> torch.Tensor:
        return _to_torch([n.value for n in self._nodes()])

    def check_integrity(self) -> None:
        ps = self.page_size
        nodes = self._nodes()
        evictable = protected = 0
        direct_locks = self._root.ref - sum(c.ref for c in self._root.children.values())
        in_heap = 0
        for node in nodes:
            size = len(node.key)
            parent = node.parent
            _require(
                size > 0 and size % ps == 0, f"node size {size} not a positive multiple of {ps}"
            )
            _require(node.value.shape == (size,), f"{size} tokens, slots {node.value.shape}")
            _require(node.value.dtype == np.int32, f"node slots dtype {node.value.dtype}")
            _require(
                parent is not None and parent.children.get(self._first_key(node.key, 0)) is node,
                "node not reachable from its parent under its first page",
            )
            child_refs = sum(c.ref for c in node.children.values())
            _require(node.ref >= child_refs, f"ref {node.ref} < children's {child_refs}")
            direct_locks += node.ref - child_refs
            if node.ref:
                protected += size
            else:
                evictable += size
            if parent is not self._root:
                _require(parent.last_access >= node.last_access, "parent accessed before its child")
            if node.ref == 0 and not node.children:
                _require(node.heap_seq >= 0, "unreferenced leaf missing from the eviction heap")
            in_heap += node.heap_seq >= 0
        _require(
            direct_locks == self._num_locks,
            f"{direct_locks} locks in tree, {self._num_locks} taken",
        )
        _require(evictable == self._evictable, f"evictable {self._evictable} != tree {evictable}")
        _require(protected == self._protected, f"protected {self._protected} != tree {protected}")
        _require(in_heap == len(self._heap), f"{len(self._heap)} heap entries, {in_heap} live")
        slots = self.all_indices().numpy()
        _require(np.unique(slots).size == slots.size, "a slot is cached in two places")
        if slots.size:
            pages = slots.reshape(-1, ps)
            _require(bool((pages[:, 0] % ps == 0).all()), "a cached page does not start on a page")
            whole = pages[:, :1] + np.arange(ps, dtype=np.int32)
            _require(bool((pages == whole).all()), "a cached page is not whole")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(f"RadixPrefixCache: {message}")


def _to_torch(values: list[np.ndarray]) -> torch.Tensor:
    if not values:
        return EMPTY_INDICES
    return torch.from_numpy(np.concatenate(values))


def _to_numpy(indices: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        return indices.to(device="cpu", dtype=torch.int32).numpy()
    return np.asarray(indices, dtype=np.int32)
