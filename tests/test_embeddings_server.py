"""``POST /v1/embeddings`` in a real server, through the ``openai`` SDK.

One ``hypercorn api:app`` subprocess serves the tiny chat model and a tiny
random BERT embedding model built here (``tests.tiny_bert``). The vectors it
answers must equal mlx-embeddings' own for the same inputs (its ``generate``
for texts, the model's forward pass for token ids); base64 must decode to the
same floats; requests sent together must get the vectors they get one at a
time; every bad request is a 4xx naming its field; ``/metrics`` counts what was
embedded; a chat completion still works beside it.
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import pytest

from api.openapi import openapi_document
from tests.test_server_process import hypercorn_args, spawn_server, stop_server
from tests.tiny_bert import MAX_POSITIONS, build_tiny_bert

pytestmark = pytest.mark.server  # starts a hypercorn subprocess

TEXTS = [
    "the quick brown fox",
    "embeddings map text to vectors",
    "a server answers many clients at once, and batching puts several inputs through the "
    "model in one pass",
    "snowy oslo",
]


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory) -> str:
    return str(build_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert", seed=1))


@pytest.fixture(scope="module")
def reference(bert_path):
    """mlx-embeddings' own model and tokenizer, loaded in this process."""
    import mlx_embeddings

    return mlx_embeddings.load(bert_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, bert_path):
    env = {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_EMBEDDING_MODEL": bert_path,
           "MLX_TRIO_EMBEDDING_BATCH_SIZE": "3"}
    proc, base = spawn_server(hypercorn_args, env)
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def sdk(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=20)


def library_vectors(reference, texts: list[str]) -> np.ndarray:
    import mlx_embeddings

    model, tokenizer = reference
    return np.array(mlx_embeddings.generate(model, tokenizer, texts=texts).text_embeds)


def library_vector_of_ids(reference, ids: list[int]) -> np.ndarray:
    import mlx.core as mx

    model, _ = reference
    return np.array(model(mx.array([ids]), attention_mask=mx.ones((1, len(ids)))).text_embeds[0])


def test_the_sdk_gets_the_librarys_vectors_for_texts_and_token_ids(sdk, bert_path, reference):
    expected = library_vectors(reference, TEXTS)
    for encoding in ("float", "base64"):  # the SDK asks for base64 unless told otherwise
        kwargs = {} if encoding == "base64" else {"encoding_format": "float"}
        answer = sdk.embeddings.create(model=bert_path, input=TEXTS, **kwargs)
        got = np.array([item.embedding for item in answer.data])
        assert [item.index for item in answer.data] == list(range(len(TEXTS)))
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert answer.model == bert_path
    _, tokenizer = reference
    token_counts = [len(tokenizer(text)["input_ids"]) for text in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(token_counts)

    one = sdk.embeddings.create(model=bert_path, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, expected[1], atol=1e-5)

    ids = [[7, 8, 9, 10], [11, 12], list(range(5, 5 + MAX_POSITIONS))]
    by_ids = sdk.embeddings.create(model=bert_path, input=ids, encoding_format="float")
    for item, row in zip(by_ids.data, ids, strict=True):
        np.testing.assert_allclose(item.embedding, library_vector_of_ids(reference, row), atol=1e-5)
    assert by_ids.usage.prompt_tokens == sum(len(row) for row in ids)
    single_ids = sdk.embeddings.create(model=bert_path, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(single_ids.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)


def test_base64_decodes_to_the_same_float32_values(server, bert_path):
    answers = {
        encoding: httpx.post(f"{server}/v1/embeddings", timeout=30, json={
            "model": bert_path, "input": TEXTS, "encoding_format": encoding}).json()
        for encoding in ("float", "base64")
    }
    document = openapi_document()
    for answer in answers.values():  # the shape /openapi.json states
        jsonschema.Draft202012Validator(
            {"$ref": "#/components/schemas/EmbeddingList", "components": document["components"]}
        ).validate(answer)
    for as_float, as_base64 in zip(answers["float"]["data"], answers["base64"]["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(as_base64["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.array(as_float["embedding"], dtype=np.float32).tolist()
        assert abs(float(np.linalg.norm(decoded)) - 1.0) < 1e-5


def test_requests_sent_together_get_the_vectors_they_get_alone(server, bert_path):
    texts = [f"{TEXTS[i % len(TEXTS)]} number {i}" for i in range(12)]

    def ask(text: str) -> list[float]:
        response = httpx.post(f"{server}/v1/embeddings", timeout=60, json={
            "model": bert_path, "input": text, "encoding_format": "float"})
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    alone = [ask(text) for text in texts]
    with ThreadPoolExecutor(len(texts)) as pool:
        together = list(pool.map(ask, texts))
    np.testing.assert_allclose(together, alone, atol=1e-5)
    # all twelve in one request: passes of at most 3 (MLX_TRIO_EMBEDDING_BATCH_SIZE)
    response = httpx.post(f"{server}/v1/embeddings", timeout=60, json={
        "model": bert_path, "input": texts, "encoding_format": "float"})
    np.testing.assert_allclose([d["embedding"] for d in response.json()["data"]], alone, atol=1e-5)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "x"}, 400, "model"),
    ({"model": "BERT", "input": ""}, 400, "input"),
    ({"model": "BERT", "input": []}, 400, "input"),
    ({"model": "BERT", "input": ["a", ""]}, 400, "input[1]"),
    ({"model": "BERT", "input": ["a", 3]}, 400, "input[1]"),
    ({"model": "BERT", "input": [[1, 2], [3, -1]]}, 400, "input[1][1]"),
    ({"model": "BERT", "input": {"text": "a"}}, 400, "input"),
    ({"model": "BERT", "input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": "BERT", "input": "a", "dimensions": 0}, 400, "dimensions"),
    ({"model": "BERT", "input": "a", "dimensions": 16}, 400, "dimensions"),  # not Matryoshka
    ({"model": "BERT", "input": ["a", "b " * MAX_POSITIONS]}, 400, "input[1]"),  # too long
    ({"model": "BERT", "input": [[1], [10**6]]}, 400, "input[1]"),  # outside the vocabulary
    ({"model": "BERT", "input": [[1]] * 2049}, 400, "input"),  # more than 2048 inputs
    ({"model": "no-such-model", "input": "a"}, 404, "model"),
    ({"model": "default_model", "input": "a"}, 400, "model"),  # the chat model
])
def test_bad_requests_are_4xx_naming_the_field(server, bert_path, body, status, param):
    if body.get("model") == "BERT":
        body = {**body, "model": bert_path}
    response = httpx.post(f"{server}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param.split("[")[0] in error["message"]


def test_the_sdk_raises_the_servers_4xx(sdk, bert_path):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        sdk.embeddings.create(model=bert_path, input=["fine", ""])
    assert raised.value.body["param"] == "input[1]"
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="other", input="a")


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_metrics_count_requests_inputs_tokens_and_passes(server, bert_path):
    before = {name: metric(server, f"mlx_trio_{name}") for name in (
        "embedding_requests_total{outcome=\"ok\"}", "embedding_inputs_total",
        "embedding_tokens_total", "embedding_batch_size_count", "embedding_batch_size_sum")}
    answer = httpx.post(f"{server}/v1/embeddings", timeout=30, json={
        "model": bert_path, "input": TEXTS + TEXTS[:3]}).json()  # 7 inputs: passes of 3, 3, 1
    after = {name: metric(server, f"mlx_trio_{name}") for name in before}
    delta = {name: after[name] - before[name] for name in before}
    assert delta["embedding_requests_total{outcome=\"ok\"}"] == 1
    assert delta["embedding_inputs_total"] == 7
    assert delta["embedding_tokens_total"] == answer["usage"]["prompt_tokens"]
    assert delta["embedding_batch_size_sum"] == 7
    assert delta["embedding_batch_size_count"] == 3


def test_models_and_health_list_the_embedding_model_and_chat_still_answers(server, bert_path):
    ids = [card["id"] for card in httpx.get(f"{server}/v1/models", timeout=10).json()["data"]]
    assert bert_path in ids and len(ids) >= 2
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert health["embeddings"]["state"] == "ready"
    assert health["embeddings"]["max_tokens"] == MAX_POSITIONS
    chat = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1
