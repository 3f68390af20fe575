"""The engine's prompt-cache index: mlx-lm's prompt trie as a radix trie.

Owns ``RadixPromptTrie``, which takes the place of ``LRUPromptCache``'s
``PromptTrie`` in the engine's store (``runtime.prompt_cache_store``, through
``runtime.mlx_lm_internals.use_prompt_trie``): the same methods (``add``,
``get``, ``pop``, ``pop_prefixes``, ``search``) with the same results, the
nearest longer entry included, and lookups of its own for the store's
shortcuts (``shared_prefix``, ``value``) and its shared spans
(``prefix_values``). Receives token sequences and the store's entries; emits
nothing.

Why: mlx-lm's trie holds one dict per token. Storing a 30k-token prompt made
30,000 of them (8 ms of the engine thread on an H200's host, in the profile
of the step that kept a segment), and each is an object that every full
collection of the cyclic garbage collector walks, in whichever step sets it
off: sixteen agent sessions over a 24k-token system prompt made 120,000, and
one full collection about 10 ms on this repository's CPU
(``bench/prompt_trie_cost.py``). Here an edge holds a run of tokens
(``array('i')``), so an entry costs a few objects however long it is, and a
lookup compares runs in C. The nodes hold no reference to their parents: the
trie has no cycles, and what it drops goes by reference counting alone.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import PromptTrieResult

from runtime.token_runs import common_run, tokens_array

_NO_VALUE = object()


class _Node:
    __slots__ = ("label", "edges", "value")

    def __init__(self, label: array, value: Any = _NO_VALUE):
        self.label = label  # the tokens on the edge into this node
        self.edges: dict[int, _Node] = {}  # a child's first token -> the child, oldest first
        self.value = value


def _merged(node: _Node) -> _Node:
    """``node``, or, holding no value and one edge, that child with the two labels
    joined (the radix stays compact after a removal)."""
    if node.value is not _NO_VALUE or len(node.edges) != 1:
        return node
    (child,) = node.edges.values()
    child.label = node.label + child.label
    return child


class RadixPromptTrie:
    """mlx-lm's ``PromptTrie`` (per model, token sequences to values) as a radix trie."""

    def __init__(self) -> None:
        self._roots: dict[Any, _Node] = {}

    def _path(self, model: Any, tokens: array) -> tuple[list[_Node], int, tuple[_Node, int] | None]:
        """The nodes the walk along ``tokens`` passes (its root first), the tokens it
        matches, and the edge it stops inside with how far into it (None: at a node)."""
        node = self._roots.get(model)
        if node is None:
            return [], 0, None
        path, depth, n = [node], 0, len(tokens)
        while depth < n:
            child = node.edges.get(tokens[depth])
            if child is None:
                break
            m = common_run(child.label, tokens, depth)
            if m < len(child.label):
                return path, depth + m, (child, m)
            node, depth = child, depth + m
            path.append(node)
        return path, depth, None

    def _node_at(self, model: Any, tokens: array) -> tuple[list[_Node], _Node | None]:
        path, depth, inside = self._path(model, tokens)
        if not path or inside is not None or depth < len(tokens):
            return path, None
        return path, path[-1]

    def add(self, model: Any, tokens: Sequence[int], value: Any) -> Any:
        """Store ``value`` for ``tokens``; the value it replaces, or None."""
        tokens = tokens_array(tokens)
        node = self._roots.setdefault(model, _Node(array("i")))
        depth, n = 0, len(tokens)
        while depth < n:
            child = node.edges.get(tokens[depth])
            if child is None:
                node.edges[tokens[depth]] = _Node(tokens[depth:], value)
                return None
            m = common_run(child.label, tokens, depth)
            if m < len(child.label):  # split the edge where the tokens leave it
                middle = _Node(child.label[:m])
                node.edges[tokens[depth]] = middle  # keeps the edge's place
                child.label = child.label[m:]
                middle.edges[child.label[0]] = child
                child = middle
            node, depth = child, depth + m
        previous, node.value = node.value, value
        return None if previous is _NO_VALUE else previous

    def get(self, model: Any, tokens: Sequence[int]) -> Any:
        """The value stored for exactly ``tokens``; KeyError if none."""
        _, node = self._node_at(model, tokens_array(tokens))
        if node is None or node.value is _NO_VALUE:
            raise KeyError(tuple(tokens))
        return node.value

    def value(self, model: Any, tokens: Sequence[int]) -> Any:
        """The value stored for exactly ``tokens``, or None."""
        _, node = self._node_at(model, tokens_array(tokens))
        return None if node is None or node.value is _NO_VALUE else node.value

    def pop(self, model: Any, tokens: Sequence[int]) -> Any:
        """Remove and return the value stored for exactly ``tokens``; KeyError if none."""
        path, node = self._node_at(model, tokens_array(tokens))
        if node is None or node.value is _NO_VALUE:
            raise KeyError(tuple(tokens))
        value, node.value = node.value, _NO_VALUE
        if len(path) > 1:
            parent, key = path[-2], node.label[0]
            if not node.edges:
                del parent.edges[key]
                if len(path) > 2:  # the parent, now maybe a bare link, joins its child
                    grand = path[-3]
                    grand.edges[parent.label[0]] = _merged(parent)
            else:
                parent.edges[key] = _merged(node)
        return value

    def pop_prefixes(self, model: Any, tokens: Sequence[int]) -> list[tuple[int, Any]]:
        """Remove the values stored for the strict prefixes of ``tokens`` (the empty one
        included); ``(length, value)`` pairs, shortest first. ``tokens`` must be stored."""
        tokens = tokens_array(tokens)
        path, node = self._node_at(model, tokens)
        if node is None:
            raise KeyError(tuple(tokens))
        popped: list[tuple[int, Any]] = []
        # Each node's depth before any merge below lengthens a label on the path.
        depths = list(itertools.accumulate(len(step.label) for step in path))
        parent = None
        for step, depth in zip(path[:-1], depths, strict=False):
            if step.value is not _NO_VALUE:
                popped.append((depth, step.value))
                step.value = _NO_VALUE
            kept = step if parent is None else _merged(step)
            if kept is step:
                parent = step
            else:  # a bare link now: its one child, on the path, takes its edge
                parent.edges[step.label[0]] = kept
        return popped

    def prefix_values(self, model: Any, tokens: Sequence[int]) -> list[tuple[int, Any]]:
        """``(length, value)`` of every stored prefix of ``tokens`` (``tokens`` itself
        included), shortest first."""
        found, depth = [], 0
        for node in self._path(model, tokens_array(tokens))[0]:
            depth += len(node.label)
            if node.value is not _NO_VALUE:
                found.append((depth, node.value))
        return found

    def shared_prefix(self, model: Any, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` some stored sequence shares with them."""
        return self._path(model, tokens_array(tokens))[1]

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        """mlx-lm's ``PromptTrie.search``: the entry for exactly ``tokens``, else the
        longest stored strict prefix of them (of 2 tokens at least), the nearest entry
        beyond where they part (fewest further tokens; among those, the one mlx-lm's
        depth-first search, newest edge first, meets first), and how far they go along."""
        root = self._roots.get(model)
        if root is None:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and root.value is not _NO_VALUE:
            return PromptTrieResult(model, [], None, None, 0)
        run = tokens_array(tokens)
        node, depth, last, inside = root, 0, -1, None
        while depth < len(run):
            child = node.edges.get(run[depth])
            if child is None:
                break
            m = common_run(child.label, run, depth)
            if m < len(child.label):
                inside, depth = (child, m), depth + m
                break
            node, depth = child, depth + m
            if node.value is not _NO_VALUE:
                last = depth - 1
        if last == len(run) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = None
        if depth > 0:
            start = (node, array("i")) if inside is None else (inside[0], inside[0].label[inside[1]:])
            longer = tokens[:depth] + _nearest_beyond(*start).tolist()
        return PromptTrieResult(model, None, shorter, longer, depth)


def _nearest_beyond(node: _Node, extra: array) -> array:
    """The fewest further tokens below ``node`` (``extra`` of them so far) to a stored
    value, found as mlx-lm's trie finds them: depth first, newest edge first, a node
    with a value not searched below, a branch no shorter than the best left alone."""
    best: array | None = None
    stack = [(node, extra)]
    while stack:
        node, extra = stack.pop()
        if node.value is not _NO_VALUE:
            if best is None or len(extra) < len(best):
                best = extra
        elif best is None or len(extra) < len(best):
            stack.extend((child, extra + child.label) for child in node.edges.values())
    if best is None:
        raise RuntimeError("a branch of the prompt trie holds no value")
    return best
