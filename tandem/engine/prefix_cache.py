"""The prefix cache: a radix tree over whole pages of token ids whose nodes reference KV pages.

An edge holds ``k * page_size`` tokens and their ``k`` pages; the tree holds one reference on
each page it lists. A hit shares those pages with the new request (its page table takes a
reference: zero copy), also while the request that wrote them is still running. Only whole
pages are cached and shared: a prompt's partially filled last page is recomputed (at most
``page_size - 1`` tokens), never copied.

A page whose only reference is the tree's is *cached*; a leaf all of whose pages are cached is
evictable (least recently used first). Pages a live request holds are locked by its reference.

Models with recurrent layers: a node may also hold a *snapshot*, the recurrent state after the
tokens up to its end (a slot of ``Snapshots``). Such a model can only resume where a state
was kept, so its hits end at the deepest snapshot on the matched path (``match_hit``).

Models with sliding-window layers whose pages are freed behind the window (``KVManager``'s
window group): each node also lists the window layers' pages of its positions, -1 where none
is kept. A hit of ``L`` tokens needs the window pages of positions ``[L - W + 1, L)``, so it
ends where they are all there. A window page only the tree holds may be dropped on its own,
wherever it is (``drop_window``): a node keeps its full-attention pages without it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tandem.engine.pages import PageAllocator
from tandem.engine.state_slots import Snapshots

_clock = itertools.count(1)


# Most pages an eviction frees beyond what it was asked for (``PrefixCache.evict``).
EVICT_BATCH = 256


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_access: int = 0
    snapshot: int = -1  # recurrent state after this node's last token (-1: none)
    wpages: list[int] = field(default_factory=list)  # window group's pages (-1: none)


@dataclass(frozen=True)
class StateHit:
    """A prefix-cache hit: its pages, the snapshot a model with recurrent layers resumes from
    (-1: none; the pages then end at the deepest snapshot, none: the hit is empty), and the
    tokens the tree matched in all."""

    pages: list[int]
    snapshot: int
    matched: int
    wpages: list[int] = field(default_factory=list)  # the window group's (-1: none kept)


class PrefixCache:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        snapshots: Snapshots | None = None,
        *,
        window_alloc: PageAllocator | None = None,
        window: int = 0,
    ) -> None:
        self.alloc = allocator
        self.page_size = page_size
        self.snapshots = snapshots
        self.walloc = window_alloc
        self.window = window
        self.root = Node()
        self.num_pages = 0  # pages the tree references

    def _key(self, tokens: tuple[int, ...] | list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.page_size])

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The cached pages of the longest whole-page prefix of ``tokens[:limit]``; marks the
        path recently used. Splits an edge where the match ends inside it."""
        return [pg for node in self._walk(tokens, limit) for pg in node.pages]

    def match_hit(self, tokens: list[int], limit: int) -> StateHit:
        """The longest whole-page prefix of ``tokens[:limit]`` a request can resume from:
        with snapshots, cut at the deepest node on the path that holds one; with a window
        group, where the window pages before the cut are there."""
        path = self._walk(tokens, limit)
        pages = [pg for node in path for pg in node.pages]
        matched = len(pages) * self.page_size
        wpages = [pg for node in path for pg in node.wpages]
        ok = self._window_ok(wpages)
        if self.snapshots is None:
            n = next(n for n in range(len(pages), -1, -1) if ok(n))
            return StateHit(pages[:n], -1, matched, self._window_of(wpages, n))
        ends = itertools.accumulate(len(node.pages) for node in path)
        at = [(end, node.snapshot) for end, node in zip(ends, path, strict=True)]
        end, snap = next(((e, s) for e, s in reversed(at) if s >= 0 and ok(e)), (0, -1))
        return StateHit(pages[:end], snap, matched, self._window_of(wpages, end))

    def _window_of(self, wpages: list[int], n: int) -> list[int]:
        """A hit of ``n`` pages gets the window pages its next position reads, -1 before."""
        if self.walloc is None:
            return []
        lo = max(0, n * self.page_size - self.window + 1) // self.page_size
        return [-1] * lo + wpages[lo:n]

    def _window_ok(self, wpages: list[int]):
        """Whether a hit of ``n`` pages has the window pages its next position reads."""
        if self.walloc is None:
            return lambda n: True
        last_missing = [-1]  # last_missing[n]: the last index < n without a window page
        for i, pg in enumerate(wpages):
            last_missing.append(i if pg < 0 else last_missing[i])
        p, w = self.page_size, self.window
        return lambda n: last_missing[n] < max(0, n * p - w + 1) // p

    def _walk(self, tokens: list[int] | tuple[int, ...], limit: int) -> list[Node]:
        """The nodes of the longest whole-page prefix of ``tokens[:limit]`` in the tree, the
        last one split so the path ends exactly there; marked recently used."""
        p = self.page_size
        node, pos, path = self.root, 0, []
        stamp = next(_clock)
        while pos + p <= limit:
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            n = 1  # whole pages of the edge that match (the first one did, by its key)
            edge_pages = len(child.pages)
            while (
                n < edge_pages
                and pos + (n + 1) * p <= limit
                and child.tokens[n * p : (n + 1) * p]
                == tuple(tokens[pos + n * p : pos + (n + 1) * p])
            ):
                n += 1
            if n < edge_pages:
                child = self._split(child, n)
            child.last_access = stamp
            path.append(child)
            pos += n * p
            node = child
        return path

    def snapshot_at(self, tokens: list[int] | tuple[int, ...], pos: int) -> int:
        """The snapshot after ``tokens[:pos]`` (-1: none); changes nothing."""
        p = self.page_size
        node, at = self.root, 0
        while at < pos:
            child = node.children.get(self._key(tokens, at))
            if child is None or child.tokens != tuple(tokens[at : at + len(child.tokens)]):
                return -1
            at += len(child.tokens)
            node = child
        assert at % p == 0
        return node.snapshot if at == pos else -1

    def attach(self, tokens: list[int] | tuple[int, ...], pos: int, slot: int) -> bool:
        """Keep ``slot`` (the caller's reference, taken over) as the state after
        ``tokens[:pos]``, whose pages are in the tree. False (the caller keeps its reference)
        when the tree already holds a state there."""
        assert pos > 0 and pos % self.page_size == 0
        path = self._walk(tokens, pos)
        assert path and sum(len(n.pages) for n in path) * self.page_size == pos, "no pages"
        if path[-1].snapshot >= 0:
            return False
        path[-1].snapshot = slot
        return True

    def evict_snapshot(self) -> bool:
        """Drop the least recently used snapshot no request is about to read; False when
        there is none."""
        assert self.snapshots is not None
        refs = self.snapshots.refs
        held = [n for n in self._nodes() if n.snapshot >= 0 and refs[n.snapshot] == 1]
        if not held:
            return False
        node = min(held, key=lambda n: n.last_access)
        self.snapshots.decref(node.snapshot)
        node.snapshot = -1
        return True

    def _drop_snapshot(self, node: Node) -> None:
        if node.snapshot >= 0:
            assert self.snapshots is not None
            self.snapshots.decref(node.snapshot)
            node.snapshot = -1

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child``'s edge after ``n`` pages; returns the upper half."""
        p = self.page_size
        parent = child.parent
        assert parent is not None
        upper = Node(child.tokens[: n * p], child.pages[:n], parent, {}, child.last_access)
        upper.wpages, child.wpages = child.wpages[:n], child.wpages[n:]
        parent.children[self._key(upper.tokens, 0)] = upper
        child.tokens, child.pages, child.parent = child.tokens[n * p :], child.pages[n:], upper
        upper.children[self._key(child.tokens, 0)] = child
        return upper

    def insert(
        self,
        tokens: list[int] | tuple[int, ...],
        pages: list[int] | tuple[int, ...],
        wpages: list[int] | tuple[int, ...] = (),
    ) -> list[int]:
        """Cache whole pages: ``tokens`` (len(pages) * page_size of them) whose KV is in
        ``pages`` (and the window group's ``wpages``, -1 where the caller has freed them),
        held by the caller. Where the tree already has other pages for the same tokens it
        keeps its own (KV depends only on the tokens up to a position, so chains may mix
        writers) and the caller's copy dies with the caller; a window page the tree lacks
        it takes. Returns those pages of the tree's on the path that the caller does not
        hold: it must lock them while it lives, so a page the tree caches never sits above
        one a live request holds (window pages need no lock: each can go on its own)."""
        p = self.page_size
        assert len(tokens) == len(pages) * p
        if self.walloc is not None:
            assert len(wpages) == len(pages)
        node, pos, foreign = self.root, 0, []
        stamp = next(_clock)
        while pos < len(tokens):
            key = self._key(tokens, pos)
            child = node.children.get(key)
            if child is None:
                new = Node(tuple(tokens[pos:]), list(pages[pos // p :]), node, {}, stamp)
                if self.walloc is not None:
                    new.wpages = list(wpages[pos // p :])
                    self.walloc.tree_ref([pg for pg in new.wpages if pg >= 0])
                node.children[key] = new
                self.alloc.tree_ref(new.pages)
                self.num_pages += len(new.pages)
                break
            n = 1
            while (
                n < len(child.pages)
                and pos + (n + 1) * p <= len(tokens)
                and child.tokens[n * p : (n + 1) * p]
                == tuple(tokens[pos + n * p : pos + (n + 1) * p])
            ):
                n += 1
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = stamp
            base = pos // p
            foreign += [pg for i, pg in enumerate(child.pages) if pg != pages[base + i]]
            if self.walloc is not None:
                for i, pg in enumerate(child.wpages):
                    if pg < 0 and wpages[base + i] >= 0:
                        child.wpages[i] = wpages[base + i]
                        self.walloc.tree_ref([wpages[base + i]])
            pos += n * p
            node = child
        return foreign

    def evict(self, want: int) -> int:
        """Free at least ``want`` pages (fewer if the tree cannot), least recently used
        unlocked leaves first; returns the pages freed. Frees a 64th of the pool (at most
        ``EVICT_BATCH`` pages) at least, so admitting many prompts into a full cache walks it
        a few times, not once a prompt (256 prompts of 16 pages: 0.4 s of walks), and a big
        pool does not lose thousands of cached pages to one page's need."""
        want = max(want, min(self.alloc.num_pages // 64, EVICT_BATCH))
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < want:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._key(node.tokens, 0)]
            self._drop_snapshot(node)
            self._drop_wpages(node, all_of_them=True)
            self.num_pages -= len(node.pages)
            freed += self.alloc.tree_unref(node.pages)
            if parent is not self.root and self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _evictable_leaf(self, node: Node) -> bool:
        return not node.children and all(self.alloc.refs[pg] == 1 for pg in node.pages)

    def drop_window(self, want: int) -> int:
        """Free at least ``want`` window pages only the tree holds (fewer if there are not
        that many), least recently used nodes first; returns the pages freed. Frees a
        64th of the group at least, so a warm cache is not walked for every page."""
        assert self.walloc is not None
        want = max(want, self.walloc.num_pages // 64)
        refs = self.walloc.refs
        nodes = [n for n in self._nodes() if any(pg >= 0 and refs[pg] == 1 for pg in n.wpages)]
        freed = 0
        for node in sorted(nodes, key=lambda n: n.last_access):
            if freed >= want:
                break
            freed += self._drop_wpages(node, all_of_them=False)
        return freed

    def _drop_wpages(self, node: Node, *, all_of_them: bool) -> int:
        """Drop the node's window pages (``all_of_them``: also those a request holds too,
        whose reference stays with it); returns how many became free."""
        if self.walloc is None:
            return 0
        freed = 0
        for i, pg in enumerate(node.wpages):
            if pg >= 0 and (all_of_them or self.walloc.refs[pg] == 1):
                freed += self.walloc.tree_unref([pg])
                node.wpages[i] = -1
        return freed

    def clear(self) -> None:
        for node in self._nodes():
            self._drop_snapshot(node)
            self._drop_wpages(node, all_of_them=True)
            self.alloc.tree_unref(node.pages)
        self.root = Node()
        self.num_pages = 0

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def page_refs(self) -> dict[int, int]:
        """How many times the tree references each page (at most once when consistent)."""
        refs: dict[int, int] = {}
        for n in self._nodes():
            for pg in n.pages:
                refs[pg] = refs.get(pg, 0) + 1
        return refs

    def check(self) -> None:
        p = self.page_size
        total = 0
        for n in self._nodes():
            assert n.parent is not None and n.parent.children.get(self._key(n.tokens, 0)) is n
            assert n.pages and len(n.tokens) == len(n.pages) * p, "edge is not whole pages"
            total += len(n.pages)
        assert total == self.num_pages, "tree page count out of sync"
        refs = self.page_refs()
        assert all(c == 1 for c in refs.values()), "the tree lists a page twice"
        assert set(refs) == {pg for pg, t in enumerate(self.alloc.in_tree) if t}
        snaps = self.snapshot_refs()
        assert all(c == 1 for c in snaps.values()), "two nodes hold one snapshot"
        if self.walloc is not None:
            assert all(len(n.wpages) == len(n.pages) for n in self._nodes())
            wrefs = self.wpage_refs()
            assert all(c == 1 for c in wrefs.values()), "the tree lists a window page twice"
            assert set(wrefs) == {pg for pg, t in enumerate(self.walloc.in_tree) if t}

    def wpage_refs(self) -> dict[int, int]:
        """How many times the tree references each window page."""
        refs: dict[int, int] = {}
        for n in self._nodes():
            for pg in n.wpages:
                if pg >= 0:
                    refs[pg] = refs.get(pg, 0) + 1
        return refs

    def snapshot_refs(self) -> dict[int, int]:
        """How many nodes hold each snapshot slot (at most one when consistent)."""
        refs: dict[int, int] = {}
        for n in self._nodes():
            if n.snapshot >= 0:
                refs[n.snapshot] = refs.get(n.snapshot, 0) + 1
        return refs
