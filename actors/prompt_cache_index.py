"""The prompt-cache policy's token index: a radix trie of token sequences, per model.

Owns no I/O and no MLX; receives token sequences (``array('i')``) with an id,
and answers, for a prompt, what mlx-lm's ``LRUPromptCache`` lookup would see
(``walk``): how many leading tokens some entry shares with it, whether an
entry holds exactly these tokens, the longest entry that is a prefix of it,
and whether the entries beyond the shared part can be cut to it.

A radix trie (edges labelled with runs of tokens, stored as compact
``array('i')``) rather than mlx-lm's trie of one dict per token: the actor runs
on the event loop, and a long conversation costs a handful of nodes and 4
bytes per token here instead of a dict per token; comparing a run is one C
comparison. Each node counts the entries below it (and those that cannot be
trimmed), so a subtree's answer needs no search.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import attrs

from runtime.token_runs import common_run, tokens_array


class _Node:
    __slots__ = ("parent", "label", "edges", "entries", "count", "untrimmable")

    def __init__(self, parent: _Node | None, label: array):
        self.parent = parent
        self.label = label  # the tokens on the edge from the parent to this node
        self.edges: dict[int, _Node] = {}  # first token of a child's label -> child
        self.entries: dict[int, bool] = {}  # entries ending here: id -> trimmable
        self.count = 0  # entries in this subtree, this node's included
        self.untrimmable = 0  # of which cannot be trimmed


@attrs.frozen
class Walk:
    """What a lookup of ``tokens`` sees in the index (one model's entries)."""

    depth: int  # leading tokens some entry shares with them
    exact: bool | None  # an entry holds exactly these tokens: whether it can be trimmed
    prefix: int  # the longest entry (at least 2 tokens) that is a strict prefix of them
    beyond: bool | None  # entries extend past the shared part: whether all can be trimmed
    nearest: int | None  # an entry id at or below the end of the shared part, or on the way


class TokenTrie:
    """Token sequences by id, per model; ``walk`` answers prefix questions."""

    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}
        self._where: dict[int, tuple[str, _Node]] = {}  # id -> (model, node it ends at)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._where

    def add(self, model: str, tokens: Sequence[int], entry_id: int, trimmable: bool) -> None:
        if entry_id in self._where:
            raise ValueError(f"entry {entry_id} is already indexed")
        tokens = tokens_array(tokens)
        node = self._roots.get(model)
        if node is None:
            node = self._roots[model] = _Node(None, array("i"))
        depth, n = 0, len(tokens)
        while depth < n:
            child = node.edges.get(tokens[depth])
            if child is None:
                leaf = _Node(node, tokens[depth:])
                node.edges[tokens[depth]] = leaf
                node, depth = leaf, n
                break
            m = common_run(child.label, tokens, depth)
            if m < len(child.label):  # split the edge where the tokens leave it
                mid = _Node(node, child.label[:m])
                mid.count, mid.untrimmable = child.count, child.untrimmable
                node.edges[tokens[depth]] = mid
                child.label = child.label[m:]
                child.parent = mid
                mid.edges[child.label[0]] = child
                child = mid
            node, depth = child, depth + m
        node.entries[entry_id] = trimmable
        self._where[entry_id] = (model, node)
        up: _Node | None = node
        while up is not None:
            up.count += 1
            up.untrimmable += not trimmable
            up = up.parent

    def remove(self, entry_id: int) -> tuple[str, array]:
        """Forget an entry; returns its (model, tokens)."""
        model, node = self._where.pop(entry_id)
        tokens = self._tokens_to(node)
        trimmable = node.entries.pop(entry_id)
        up: _Node | None = node
        while up is not None:
            up.count -= 1
            up.untrimmable -= not trimmable
            up = up.parent
        # Prune what holds nothing now, then merge a node left with one child.
        while node.parent is not None and node.count == 0:
            del node.parent.edges[node.label[0]]
            node = node.parent
        if node.parent is None:
            if node.count == 0:
                del self._roots[model]
        elif not node.entries and len(node.edges) == 1:
            (child,) = node.edges.values()
            child.label = node.label + child.label
            child.parent = node.parent
            node.parent.edges[child.label[0]] = child
        return model, tokens

    def tokens(self, entry_id: int) -> array:
        return self._tokens_to(self._where[entry_id][1])

    @staticmethod
    def _tokens_to(node: _Node) -> array:
        labels = []
        up: _Node | None = node
        while up is not None:
            labels.append(up.label)
            up = up.parent
        out = array("i")
        for label in reversed(labels):
            out.extend(label)
        return out

    def walk(self, model: str, tokens: Sequence[int]) -> Walk:
        tokens = tokens_array(tokens)
        n = len(tokens)
        node = self._roots.get(model)
        if node is None:
            return Walk(depth=0, exact=None, prefix=0, beyond=None, nearest=None)
        depth, prefix, nearest = 0, 0, None
        beyond_node: _Node | None = None  # the subtree past the shared part
        while True:
            if node.entries and depth:
                nearest = next(iter(node.entries))
                if depth == n:
                    return Walk(
                        depth=depth,
                        exact=all(node.entries.values()),
                        prefix=prefix,
                        beyond=None,
                        nearest=nearest,
                    )
                if depth >= 2:
                    prefix = depth
            if depth == n:
                beyond_node = node
                break
            child = node.edges.get(tokens[depth])
            if child is None:
                # mlx-lm's "longer" search starts here, this node's own entry included.
                beyond_node = node if depth else None
                break
            m = common_run(child.label, tokens, depth)
            if m < len(child.label):
                depth += m
                beyond_node = child if depth else None
                break
            node, depth = child, depth + m
        beyond = None
        if beyond_node is not None and beyond_node.count:
            beyond = beyond_node.untrimmable == 0
            nearest = _any_entry(beyond_node)
        return Walk(depth=depth, exact=None, prefix=prefix, beyond=beyond, nearest=nearest)


def _any_entry(node: _Node) -> int | None:
    while True:
        if node.entries:
            return next(iter(node.entries))
        if not node.edges:
            return None
        node = next(iter(node.edges.values()))
