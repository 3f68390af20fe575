"""The engine's radix prompt trie against mlx-lm's ``PromptTrie``, operation by operation.

``runtime.prompt_trie.RadixPromptTrie`` takes the place of the trie inside the
engine's ``LRUPromptCache``, so every answer must be mlx-lm's: any sequence of
adds, pops, prefix pops, gets and searches (the nearest longer entry and its
ties included) over a small alphabet, where runs share, split and merge, gives
the same results and the same errors in both. Then the store's own lookups
(``shared_prefix``, ``value``), and what it costs: a 30k-token entry is a
handful of objects.
"""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import PromptTrie

from runtime.prompt_trie import _NO_VALUE, RadixPromptTrie
from runtime.token_runs import common_run, tokens_array

# Sequences drawn as prefixes of a few words over a small alphabet: they share
# beginnings, branch and extend each other, so edges split and merge.
words = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=9), min_size=1, max_size=4)
steps = st.lists(
    st.tuples(st.sampled_from(["add", "add", "pop", "pop_prefixes", "get", "search"]),
              st.sampled_from("ab"), st.integers(0, 3), st.integers(0, 9)),
    max_size=60,
)


def outcome(method, *args):
    try:
        return "ok", method(*args)
    except KeyError:
        return "KeyError", None


@settings(max_examples=1000, deadline=None)
@given(words, steps)
def test_every_operation_answers_as_mlx_lms_trie(pool, ops):
    theirs, ours = PromptTrie(), RadixPromptTrie()
    stored: dict[tuple, list] = {}  # what add has stored, for pop_prefixes' precondition
    for n, (op, model, word, cut) in enumerate(ops):
        tokens = pool[word % len(pool)][:cut]
        if op == "add":
            assert ours.add(model, tokens, n) == theirs.add(model, tokens, n)
            stored[model, tuple(tokens)] = tokens
        elif op == "pop_prefixes":
            if (model, tuple(tokens)) not in stored:
                continue  # mlx-lm calls it for an entry just added only
            assert ours.pop_prefixes(model, tokens) == theirs.pop_prefixes(model, tokens)
        elif op == "pop":
            assert outcome(ours.pop, model, tokens) == outcome(theirs.pop, model, tokens)
            stored.pop((model, tuple(tokens)), None)
        elif op == "get":
            assert outcome(ours.get, model, tokens) == outcome(theirs.get, model, tokens)
        else:
            if model not in theirs._trie and model in ours._roots:
                continue  # mlx-lm keeps a model's root from its first add on; so do we
            assert ours.search(model, tokens) == theirs.search(model, tokens)
        # Whatever happened, both hold the same sequences.
        for m, t in list(stored):
            if outcome(theirs.get, m, list(t))[0] == "KeyError":
                del stored[m, t]
        for (m, _), full in stored.items():
            assert ours.get(m, full) == theirs.get(m, full)
            assert ours.value(m, full) == theirs.get(m, full)
        assert_compact(ours)


def assert_compact(trie: RadixPromptTrie) -> None:
    """Every node but a root holds a value or branches, and every leaf holds a value."""
    for root in trie._roots.values():
        stack = list(root.edges.values())
        while stack:
            node = stack.pop()
            assert len(node.label) > 0
            assert node.value is not _NO_VALUE or len(node.edges) >= 2, "a bare link"
            for key, child in node.edges.items():
                assert child.label[0] == key
            stack.extend(node.edges.values())


def test_a_search_finds_the_same_nearest_entry_among_ties():
    theirs, ours = PromptTrie(), RadixPromptTrie()
    for value, tokens in enumerate([[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8], [1, 2, 5, 9]]):
        theirs.add("m", tokens, value)
        ours.add("m", tokens, value)
    for probe in ([1, 2], [1, 2, 9], [1], [1, 2, 5], [1, 2, 5, 7], [3]):
        assert ours.search("m", probe) == theirs.search("m", probe)


def test_the_stores_lookups():
    trie = RadixPromptTrie()
    trie.add("m", [5, 6, 7, 8], "a")
    trie.add("m", [5, 6, 9], "b")
    assert trie.shared_prefix("m", [5, 6, 7, 1]) == 3
    assert trie.shared_prefix("m", [5, 6, 9, 9, 9]) == 3
    assert trie.shared_prefix("m", [4]) == 0
    assert trie.shared_prefix("other", [5]) == 0
    assert trie.value("m", [5, 6, 9]) == "b"
    assert trie.value("m", [5, 6]) is None
    assert trie.value("m", [5, 6, 7, 8, 1]) is None
    trie.add("m", [5], "c")
    assert trie.prefix_values("m", [5, 6, 7, 8, 9]) == [(1, "c"), (4, "a")]
    assert trie.prefix_values("m", [5, 6, 9]) == [(1, "c"), (3, "b")]
    assert trie.prefix_values("m", [5, 6]) == [(1, "c")]
    assert trie.prefix_values("other", [5]) == []


def test_common_run():
    label = tokens_array([1, 2, 3, 4, 5])
    assert common_run(label, tokens_array([9, 1, 2, 3, 4, 5, 6]), 1) == 5
    assert common_run(label, tokens_array([1, 2, 3, 7]), 0) == 3
    assert common_run(label, tokens_array([1, 2]), 0) == 2
    assert common_run(label, tokens_array([2]), 0) == 0


def test_a_long_entry_is_a_few_objects_for_the_garbage_collector():
    gc.collect()
    before = len(gc.get_objects())
    trie = RadixPromptTrie()
    system = list(range(30_000))
    trie.add("m", system, "system")
    trie.add("m", [*system, *range(100_000, 100_500)], "turn")  # shares the 30k run
    trie.add("m", [*system, *range(200_000, 200_400)], "other turn")
    assert len(gc.get_objects()) - before < 50
    assert trie.search("m", [*system, 100_000]).longer == [*system, *range(100_000, 100_500)]
