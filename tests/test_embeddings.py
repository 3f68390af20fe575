"""The embeddings path without a server of its own: batching, overload, failures, dimensions.

* ``passes``: every input in exactly one forward pass, within the bounds.
* ``EmbeddingWorker.run`` with a scripted model (no MLX forward pass): jobs
  that wait together share one pass, each gets its own rows back, a job with
  a bad input fails alone, a job whose requester left is skipped.
* The Embeddings actor: a full inbox is a 429 with ``Retry-After``; a model
  that cannot load is a 503 naming why, in ``/health`` too.
* An in-process app with ``--embedding-matryoshka``: ``dimensions`` keeps the
  leading components of the model's own vector, normalised again.
"""

from __future__ import annotations

import functools
import os
import queue
import sys
import threading

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from actors.embeddings import Embeddings, EmbeddingState
from actors.metrics import ServerMetrics
from runtime import embeddings as runtime_embeddings
from runtime.embeddings import (
    EmbeddingInfo,
    EmbeddingWorker,
    EmbedJob,
    EmbedResult,
    passes,
)
from runtime.errors import ClientError, Overloaded, Unavailable
from tests.conftest import wait_ready
from tests.tiny_bert import build_tiny_bert


@given(
    lengths=st.lists(st.integers(1, 64), max_size=40),
    batch_size=st.integers(1, 8),
    batch_tokens=st.integers(1, 200),
)
def test_passes_hold_every_input_once_within_the_bounds(lengths, batch_size, batch_tokens):
    cut = passes(lengths, batch_size, batch_tokens)
    assert sorted(i for p in cut for i in p) == list(range(len(lengths)))
    for p in cut:
        assert 1 <= len(p) <= batch_size
        longest = max(lengths[i] for i in p)
        assert len(p) == 1 or len(p) * longest <= batch_tokens


class ScriptedModel:
    """The ``EmbeddingModel`` interface: a word is a token (its length), and a vector
    says which tokens it was made from; every pass is recorded."""

    def __init__(self):
        self.max_tokens = 5
        self.info = EmbeddingInfo(family="bert", dimensions=2, max_tokens=5, vocab_size=100)
        self.pass_sizes: list[int] = []

    def tokenize(self, texts):
        return [[len(word) for word in text.split()] for text in texts]

    def embed(self, token_lists):
        self.pass_sizes.append(len(token_lists))
        return np.array([[len(ids), sum(ids)] for ids in token_lists], dtype=np.float32)


class Stop(Exception):
    pass


def run_worker(jobs: list[EmbedJob], model: ScriptedModel, monkeypatch, **bounds) -> dict:
    """Queue ``jobs``, then run the worker on a thread of its own until its inbox is
    empty; what it delivered, by job (and its thread's nice value, under "nice")."""
    monkeypatch.setattr(runtime_embeddings.EmbeddingModel, "load", staticmethod(lambda path: model))
    inbox: queue.Queue[EmbedJob] = queue.Queue()
    for job in jobs:
        inbox.put(job)
    delivered: list = []
    seen: dict = {}

    def check_cancelled():
        if delivered and inbox.empty():
            raise Stop

    def on_ready(info):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def body():
        with pytest.raises(Stop):
            worker.run(check_cancelled, on_ready, delivered.extend)
        seen["stopped"] = True

    worker = EmbeddingWorker("scripted", inbox, **bounds)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=30)
    assert seen.get("stopped"), "the worker did not stop"
    return {**dict(delivered), "nice": seen["nice"]}


def job(*inputs, single=False) -> EmbedJob:
    return EmbedJob(inputs=tuple(inputs), single=single, reply=lambda outcome: None)


def test_jobs_waiting_together_share_one_pass_and_get_their_own_rows(monkeypatch):
    model = ScriptedModel()
    a, b, c = job("aa bbb", single=True), job("c", (7, 8, 9)), job("dddd e f")
    delivered = run_worker([a, b, c], model, monkeypatch, batch_size=8, batch_tokens=100)
    assert model.pass_sizes == [4]
    assert delivered[a].vectors.tolist() == [[2, 5]]
    assert delivered[b].vectors.tolist() == [[1, 1], [3, 24]]
    assert delivered[c].vectors.tolist() == [[3, 6]]
    assert [delivered[j].prompt_tokens for j in (a, b, c)] == [2, 4, 3]


def test_passes_are_bounded_by_inputs_and_padded_tokens(monkeypatch):
    model = ScriptedModel()
    jobs = [job("a", "b c", "d e f", "g h i j", "k")]
    delivered = run_worker(jobs, model, monkeypatch, batch_size=2, batch_tokens=6)
    # lengths 1, 2, 3, 4, 1 sorted: [1, 1], [2, 3] (2 x 3 = 6), [4]
    assert model.pass_sizes == [2, 2, 1]
    assert delivered[jobs[0]].vectors[:, 0].tolist() == [1, 2, 3, 4, 1]


def test_a_bad_input_fails_its_job_alone_and_a_left_job_is_skipped(monkeypatch):
    model = ScriptedModel()
    good, long, unknown, left = job("a b"), job("a", "a b c d e f"), job((1, 100)), job("x")
    left.abandon()
    delivered = run_worker([good, long, unknown, left], model, monkeypatch,
                           batch_size=8, batch_tokens=100)
    assert isinstance(delivered[good], EmbedResult)
    assert isinstance(delivered[long], ClientError) and delivered[long].param == "input[1]"
    assert delivered[long].code == "context_length_exceeded"
    assert isinstance(delivered[unknown], ClientError) and delivered[unknown].param == "input[0]"
    assert left not in delivered
    assert model.pass_sizes == [1]


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_the_worker_thread_runs_at_a_lower_cpu_priority(monkeypatch):
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    delivered = run_worker([job("a")], ScriptedModel(), monkeypatch, batch_size=1, batch_tokens=9)
    assert delivered["nice"] == min(19, ours + runtime_embeddings.THREAD_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == ours


def actor(max_queued: int = 1) -> Embeddings:
    return Embeddings("scripted", ServerMetrics(lambda: None), max_queued=max_queued,
                      batch_size=4, batch_tokens=100)


async def test_a_full_inbox_is_a_429_with_retry_after_and_a_leaving_request_abandons_its_job():
    embeddings = actor(max_queued=1)
    embeddings._ready(EmbeddingInfo(family="bert", dimensions=2, max_tokens=5, vocab_size=100))
    async with trio.open_nursery() as nursery:
        # no thread runs: the first job stays queued
        nursery.start_soon(functools.partial(embeddings.embed, ("waits",), single=True))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(Overloaded) as raised:
            await embeddings.embed(("one too many",), single=True)
        assert raised.value.status == 429 and raised.value.retry_after == 1
        waiting = embeddings.inbox.get_nowait()
        assert not waiting.abandoned
        nursery.cancel_scope.cancel()
    assert waiting.abandoned


async def test_a_model_that_cannot_load_is_a_503_naming_why(monkeypatch):
    def fail(path):
        raise ValueError("model type 'siglip' is not one this server embeds with")

    monkeypatch.setattr(runtime_embeddings.EmbeddingModel, "load", staticmethod(fail))
    embeddings = actor()
    async with trio.open_nursery() as nursery:
        await nursery.start(embeddings.run)
        with pytest.raises(Unavailable) as raised:
            await embeddings.embed(("a",), single=True)
    assert embeddings.state is EmbeddingState.FAILED
    assert "siglip" in raised.value.message and raised.value.retry_after
    assert "siglip" in embeddings.health()["reason"]


def test_an_embedding_model_without_the_extra_installed_stops_the_start(monkeypatch):
    import importlib.util

    from runtime.config import ServerConfig
    from runtime.config_checks import unsupported

    config = ServerConfig(embedding_model="/models/bge-small")
    assert unsupported(config) == []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *more: None if name == "mlx_embeddings" else find_spec(name))
    assert any("embeddings` extra" in problem for problem in unsupported(config))


@pytest.fixture
async def matryoshka_client(tiny_model_path, tmp_path):
    from api.server import create_app
    from runtime.config import ServerConfig

    bert = str(build_tiny_bert(tmp_path / "bert", seed=2))
    config = ServerConfig(model=tiny_model_path, engine_mode="thread", embedding_model=bert,
                          embedding_matryoshka=True)
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        client.bert = bert
        yield client


async def test_dimensions_keep_the_leading_components_normalised_again(matryoshka_client):
    client = matryoshka_client

    async def ask(**extra):
        body = {"model": client.bert, "input": ["snowy oslo", "the quick fox"], **extra}
        return await client.post("/v1/embeddings", json=body)

    full = np.array([d["embedding"] for d in (await (await ask()).get_json())["data"]])
    assert full.shape == (2, 64)
    short = np.array([d["embedding"] for d in (await (await ask(dimensions=16)).get_json())["data"]])
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-6)
    too_many = await ask(dimensions=65)
    assert too_many.status_code == 400
    assert (await too_many.get_json())["error"]["param"] == "dimensions"

