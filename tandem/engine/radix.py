"""The prefix cache's index: a radix tree over token ids whose paths are KV rows.

Pure Python. KV lives in the runner's row slots, where the token at depth ``d`` of a sequence
always sits at position ``d`` of its row. So a row that holds a sequence's KV is a path from
the root, and every node lists the rows that hold its tokens (``node.rows``); a child's rows are
always a subset of its parent's. A hit of length ``m`` is served from any row of the node that
ends at depth ``m``: the request either adopts that row (when no request owns it: zero copy) or
gets a device copy of positions ``[0, m)`` into its own row.

Locks: a request that matched a path holds one lock on every node of it until it releases its
row. Its own row joins those nodes, so a locked node always has a row. Eviction works by row:
the least recently used row that no request owns leaves every node of its path; nodes left
without rows (always leaves, never locked) are deleted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # tokens on the edge from the parent
    parent: Node | None
    depth: int  # tokens from the root to the end of this node
    children: dict[int, Node] = field(default_factory=dict)
    rows: set[int] = field(default_factory=set)
    lock: int = 0

    @property
    def start(self) -> int:
        return self.depth - len(self.key)

    def path(self) -> Iterator[Node]:
        """This node and its ancestors, excluding the root."""
        node: Node | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent


@dataclass(frozen=True)
class Match:
    length: int  # matched tokens (positions [0, length) are reusable)
    node: Node  # ends exactly at ``length`` (the root when length == 0)

    @property
    def rows(self) -> set[int]:
        return self.node.rows


class RadixTree:
    def __init__(self) -> None:
        self.root = Node((), None, 0)
        self.row_tail: dict[int, Node] = {}  # row -> deepest node it holds
        self.row_used: dict[int, int] = {}  # row -> last use tick (LRU)
        self._tick = 0

    # ---- lookups ------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """Longest cached prefix of ``tokens[:limit]``; splits a node so the match ends on a
        node boundary."""
        node, i = self.root, 0
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common(child.key, tokens, i, limit)
            if n < len(child.key):
                if n > 0:
                    node = self._split(child, n)
                    i += n
                break
            node, i = child, i + n
        return Match(i, node)

    def num_tokens(self) -> int:
        """Distinct cached tokens (tree size)."""
        return sum(len(n.key) for n in self._nodes())

    # ---- row membership -----------------------------------------------------------------
    def insert(self, tokens: Sequence[int], row: int) -> None:
        """Record that ``row`` holds the KV of ``tokens`` at positions ``[0, len(tokens))``.
        The row must not already hold a different sequence (see ``truncate``)."""
        tail = self.row_tail.get(row)
        assert tail is None or tail.depth <= len(tokens), "insert would shorten a row"
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = Node(tuple(tokens[i:]), node, len(tokens))
                node.children[tokens[i]] = child
                n = len(child.key)
            else:
                n = _common(child.key, tokens, i, len(tokens))
                if n < len(child.key):
                    child = self._split(child, n)
            child.rows.add(row)
            node, i = child, i + n
        if node is not self.root:
            assert tail is None or tail in set(node.path()) or tail is node, "row path forks"
            self.row_tail[row] = node
        self.touch(row)

    def add_row(self, match: Match, row: int) -> None:
        """``row`` received a copy of the matched prefix."""
        if match.length == 0:
            return
        assert row not in self.row_tail, "row already holds a sequence"
        for node in match.node.path():
            node.rows.add(row)
        self.row_tail[row] = match.node
        self.touch(row)

    def truncate(self, row: int, length: int) -> None:
        """``row`` keeps only positions ``[0, length)`` (it is about to be overwritten past
        them). ``length`` must fall on a node boundary of the row's path."""
        tail = self.row_tail.get(row)
        if tail is None:
            return
        node: Node | None = tail
        while node is not None and node.parent is not None and node.depth > length:
            assert node.start >= length, "truncation inside a node"
            parent = node.parent
            self._drop_row(node, row)
            node = parent
        if node is None or node.parent is None:
            del self.row_tail[row]
            self.row_used.pop(row, None)
        else:
            self.row_tail[row] = node

    def rename(self, old: int, new: int) -> None:
        """The KV of row ``old`` now lives in row ``new`` (a relocation copy)."""
        assert new not in self.row_tail
        tail = self.row_tail.pop(old)
        for node in tail.path():
            node.rows.discard(old)
            node.rows.add(new)
        self.row_tail[new] = tail
        self.row_used[new] = self.row_used.pop(old, 0)

    def remove(self, row: int) -> None:
        self.truncate(row, 0)

    def touch(self, row: int) -> None:
        self._tick += 1
        self.row_used[row] = self._tick

    def holds(self, row: int) -> bool:
        return row in self.row_tail

    def row_length(self, row: int) -> int:
        tail = self.row_tail.get(row)
        return tail.depth if tail is not None else 0

    def lru(self, candidates: Iterator[int] | set[int]) -> int | None:
        """The least recently used of ``candidates`` (rows this tree holds)."""
        return min(candidates, key=lambda r: self.row_used.get(r, 0), default=None)

    # ---- locks --------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        for n in node.path():
            n.lock += 1

    def unlock(self, node: Node) -> None:
        for n in node.path():
            n.lock -= 1
            assert n.lock >= 0, "lock count went negative"

    # ---- internals ----------------------------------------------------------------------
    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = Node(child.key[:n], parent, child.start + n, rows=set(child.rows), lock=child.lock)
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _drop_row(self, node: Node, row: int) -> None:
        node.rows.discard(row)
        if not node.rows:
            assert not node.children, "a node without rows has children"
            assert node.lock == 0, "evicting a locked node"
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]

    def _nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Raise AssertionError if the tree's structure is inconsistent."""
        assert not self.root.rows and self.root.lock == 0
        for node in self._nodes():
            parent = node.parent
            assert parent is not None and parent.children.get(node.key[0]) is node
            assert node.key, "empty edge"
            assert node.depth == parent.depth + len(node.key)
            assert node.lock >= 0, "negative lock"
            assert node.rows, "node without rows"
            if parent is not self.root:
                assert node.rows <= parent.rows, "a row holds a child but not its parent"
                assert parent.lock >= node.lock, "a lock skips an ancestor"
        for row, tail in self.row_tail.items():
            assert row in tail.rows
            assert not any(row in c.rows for c in tail.children.values()), "stale tail"
        held = set().union(*(n.rows for n in self._nodes())) if self.row_tail else set()
        assert held == set(self.row_tail), "a row is in nodes without a tail"


def _common(key: tuple[int, ...], tokens: Sequence[int], i: int, limit: int) -> int:
    n = min(len(key), limit - i)
    for j in range(n):
        if key[j] != tokens[i + j]:
            return j
    return n
