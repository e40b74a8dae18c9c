"""The prefix cache: a radix tree over token ids whose nodes hold whole KV pages (kept empty for
``--cache naive``). Requests lock the prefix they reuse and insert theirs when done; unlocked leaves
are evicted least recently used by a logical clock (never wall time), so every rank evicts alike.
Requests with a ``cache_salt`` (vLLM's) share a tree of their own per salt: no other request reuses, or
can time, their prefixes."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]  # a whole number of pages of tokens
    pages: list[int]
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    ref: int = 0
    last_used: int = 0


@dataclass
class PrefixMatch:
    pages: list[int]
    node: Node | None  # lock this while the request uses ``pages``

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, page_size: int, enabled: bool = True) -> None:
        self.page_size = page_size
        self.enabled = enabled  # False (``--cache naive``): nothing is inserted, so nothing matches
        self.root = self._new_root()
        self.salted: dict[str, Node] = {}  # a root per cache_salt, dropped when its tree is evicted whole
        self.num_pages = 0  # pages held by the tree
        self.num_evictable = 0  # of those, pages no running request uses
        self.clock = 0

    @staticmethod
    def _new_root() -> Node:
        root = Node(tokens=(), pages=[])
        root.ref = 1  # never evicted
        return root

    def _root(self, salt: str | None, create: bool = False) -> Node | None:
        if salt is None:
            return self.root
        if create and salt not in self.salted:
            self.salted[salt] = self._new_root()
        return self.salted.get(salt)

    def _key(self, tokens: tuple[int, ...] | list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def match(self, tokens: list[int], salt: str | None = None) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` made of whole pages (among those of requests with ``salt``)."""
        root = self._root(salt)
        if root is None:
            return PrefixMatch([], None)
        node, pages, pos = root, [], 0
        while pos + self.page_size <= len(tokens):
            child = self._descend(node, tokens, pos)
            if child is None:
                break
            pages.extend(child.pages)
            pos += len(child.tokens)
            node = child
        return PrefixMatch(pages, node if node is not root else None)

    def _descend(self, node: Node, tokens: list[int], pos: int) -> Node | None:
        """The child of ``node`` that ``tokens[pos:]`` continues into, split to the pages they share."""
        child = node.children.get(self._key(tokens, pos))
        if child is None:
            return None
        n = self._common_pages(child, tokens, pos)
        if n < len(child.pages):
            child = self._split(child, n)
        child.last_used = self.clock
        return child

    def _common_pages(self, node: Node, tokens: list[int], pos: int) -> int:
        """How many of ``node``'s pages ``tokens[pos:]`` repeats whole."""
        n, ps = 0, self.page_size
        while n < len(node.pages) and node.tokens[n * ps : (n + 1) * ps] == self._key(tokens, pos + n * ps):
            n += 1
        return n

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut ``node`` after n_pages; returns the new upper part (same refs: same users)."""
        cut = n_pages * self.page_size
        parent = node.parent
        if parent is None:
            raise RuntimeError("cannot split the root")
        upper = Node(node.tokens[:cut], node.pages[:n_pages], parent, ref=node.ref, last_used=node.last_used)
        parent.children[self._key(upper.tokens, 0)] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[n_pages:], upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def lock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:  # up to its root
            if node.ref == 0:
                self.num_evictable -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:
            node.ref -= 1
            if node.ref == 0:
                self.num_evictable += len(node.pages)
            node = node.parent

    def insert(self, tokens: list[int], pages: list[int], salt: str | None = None) -> list[int]:
        """Cache ``pages`` holding ``tokens`` (for requests with ``salt``); returns those whose tokens it held
        already (to free)."""
        if not self.enabled:
            return list(pages)
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} pages")
        if not tokens:  # nothing to cache (a request shorter than a page): no salted tree is made for it
            return []
        duplicates: list[int] = []
        node, pos = self._root(salt, create=True), 0
        while pos < len(tokens):
            child = self._descend(node, tokens, pos)
            if child is None:
                leaf = Node(tuple(tokens[pos:]), list(pages[pos // ps :]), node, last_used=self.clock)
                node.children[self._key(leaf.tokens, 0)] = leaf
                self.num_pages += len(leaf.pages)
                self.num_evictable += len(leaf.pages)
                return duplicates
            mine = pages[pos // ps : pos // ps + len(child.pages)]
            duplicates.extend(p for p, cached in zip(mine, child.pages) if p != cached)
            pos += len(child.tokens)
            node = child
        return duplicates

    def evict(self, num_pages: int) -> list[int]:
        """Free at least ``num_pages`` (if that many are evictable), least recently used first."""
        leaves = self._leaves()
        heap = [(n.last_used, i, n) for i, n in enumerate(leaves) if n.ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        counter = len(leaves)  # tie-breakers stay unique: nodes themselves do not compare
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            freed.extend(node.pages)
            self.num_pages -= len(node.pages)
            self.num_evictable -= len(node.pages)
            parent = node.parent or self.root
            del parent.children[self._key(node.tokens, 0)]
            if parent.parent is not None and not parent.children and parent.ref == 0:
                counter += 1
                heapq.heappush(heap, (parent.last_used, counter, parent))
        for salt in [salt for salt, root in self.salted.items() if not root.children]:
            del self.salted[salt]
        return freed

    def _leaves(self) -> list[Node]:
        leaves, stack = [], [self.root, *reversed(self.salted.values())]
        while stack:  # depth-first in insertion order: the same order on every rank
            node = stack.pop()
            if not node.children and node.parent is not None:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves


def create_prefix_cache(kind: str, page_size: int) -> RadixCache:
    if kind in ("radix", "naive"):
        return RadixCache(page_size, enabled=kind == "radix")
    raise ValueError(f"cache must be radix or naive, got {kind!r}")
