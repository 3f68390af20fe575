"""``GET /metrics`` (prometheus-client, one registry per app): the values move as requests flow.

Through the app's test client on the tiny model: a chat request moves the
HTTP counter of its route and status, the request histograms (time to first
token, inter-token latency, end-to-end), the token counters by exactly the
usage it reports, the engine's step histograms by exactly its steps; a 400 is
counted under its status; a repeated prompt is a prompt-cache hit; a model
load is observed. Parsed with prometheus-client's own parser, so the text is
valid exposition format.
"""

from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics import ServerMetrics
from actors.request_timing import RequestTiming
from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import CHAT, chat_body, post, stream_post

Samples = dict[tuple[str, frozenset], float]


async def scrape(client) -> tuple[Samples, dict[str, str]]:
    """Samples by (name, labels), and each family's type."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples, types = {}, {}
    for family in text_string_to_metric_families(await response.get_data(as_text=True)):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def test_the_metrics_have_types_and_help(client):
    samples, types = await scrape(client)
    assert types["mlx_trio_http_responses"] == "counter"
    assert types["mlx_trio_requests_waiting"] == "gauge"
    assert types["mlx_trio_active_sequences"] == "gauge"
    for histogram in (
        "mlx_trio_time_to_first_token_seconds",
        "mlx_trio_request_queue_seconds",
        "mlx_trio_inter_token_latency_seconds",
        "mlx_trio_e2e_request_latency_seconds",
        "mlx_trio_engine_step_seconds",
        "mlx_trio_engine_batch_size",
        "mlx_trio_model_load_seconds",
    ):
        assert types[histogram] == "histogram", histogram
    text = await (await client.get("/metrics")).get_data(as_text=True)
    assert "# HELP mlx_trio_time_to_first_token_seconds " in text
    assert "_created" not in text
    # The start-up load was observed once, and the model is ready.
    assert value(samples, "mlx_trio_model_load_seconds_count") == 1
    assert value(samples, "mlx_trio_model_ready") == 1


async def test_a_request_moves_its_counters_and_histograms(client):
    before, _ = await scrape(client)
    status, body, _ = await post(client, CHAT, chat_body("count me", max_tokens=6))
    assert status == 200, body
    after, _ = await scrape(client)
    usage = body["usage"]
    route = "/v1/chat/completions"
    assert delta(before, after, "mlx_trio_http_responses_total", route=route, status="200") == 1
    for name in (
        "mlx_trio_time_to_first_token_seconds_count",
        "mlx_trio_request_queue_seconds_count",
        "mlx_trio_e2e_request_latency_seconds_count",
        "mlx_trio_inter_token_latency_seconds_count",
    ):
        assert delta(before, after, name) == 1, name
    assert 0 <= delta(before, after, "mlx_trio_request_queue_seconds_sum") <= delta(
        before, after, "mlx_trio_time_to_first_token_seconds_sum")
    assert delta(before, after, "mlx_trio_e2e_request_latency_seconds_sum") > 0
    assert delta(before, after, "mlx_trio_time_to_first_token_seconds_sum") <= delta(
        before, after, "mlx_trio_e2e_request_latency_seconds_sum"
    )
    reason = body["choices"][0]["finish_reason"]
    assert delta(before, after, "mlx_trio_requests_finished_total", outcome=reason) == 1
    assert delta(before, after, "mlx_trio_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta(before, after, "mlx_trio_generation_tokens_total") == usage["completion_tokens"]
    # Every engine step that ran the sequence is in the step histograms, batch size 1.
    steps = delta(before, after, "mlx_trio_engine_steps_total")
    assert steps >= usage["completion_tokens"]
    assert delta(before, after, "mlx_trio_engine_step_seconds_count") == steps
    assert delta(before, after, "mlx_trio_engine_batch_size_bucket", le="1.0") == steps
    assert delta(before, after, "mlx_trio_engine_batch_size_sum") == steps
    assert value(after, "mlx_trio_engine_step_seconds_sum") == pytest.approx(
        value(after, "mlx_trio_engine_busy_seconds_total")
    )
    # Nothing is left in flight.
    assert value(after, "mlx_trio_active_sequences") == 0
    assert value(after, "mlx_trio_requests_in_flight") == 0
    assert value(after, "mlx_trio_http_requests_in_progress") == 1  # the scrape itself


async def test_a_stream_is_counted_when_it_ends(client):
    before, _ = await scrape(client)
    status, _, raw = await stream_post(client, CHAT, chat_body("stream me", max_tokens=5, stream=True))
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    after, _ = await scrape(client)
    route = "/v1/chat/completions"
    assert delta(before, after, "mlx_trio_http_responses_total", route=route, status="200") == 1
    assert delta(before, after, "mlx_trio_e2e_request_latency_seconds_count") == 1
    assert value(after, "mlx_trio_http_requests_in_progress") == 1


async def test_a_400_counts_under_its_status_and_not_as_a_generation(client):
    before, _ = await scrape(client)
    status, body, _ = await post(client, CHAT, chat_body(max_tokens=0))
    assert status == 400 and body["error"]["param"] == "max_tokens"
    response = await client.get("/no/such/path")
    assert response.status_code == 404
    after, _ = await scrape(client)
    route = "/v1/chat/completions"
    assert delta(before, after, "mlx_trio_http_responses_total", route=route, status="400") == 1
    assert delta(before, after, "mlx_trio_http_responses_total", route=route, status="200") == 0
    assert delta(before, after, "mlx_trio_http_responses_total", route="unmatched", status="404") == 1
    assert delta(before, after, "mlx_trio_e2e_request_latency_seconds_count") == 0
    assert delta(before, after, "mlx_trio_prompt_tokens_total") == 0


async def test_a_repeated_prompt_is_a_prompt_cache_hit(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, prompt_cache_min_reuse=0))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        prompt = "a long prompt that the second request will find in the prompt cache " * 4
        before, _ = await scrape(client)
        await post(client, CHAT, chat_body(prompt, max_tokens=3))
        status, body, _ = await post(client, CHAT, chat_body(prompt, max_tokens=3))
        assert status == 200
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        after, _ = await scrape(client)
        assert delta(before, after, "mlx_trio_prompt_cache_hits_total") == 1
        assert delta(before, after, "mlx_trio_prompt_cache_hit_tokens_total") == cached
        assert value(after, "mlx_trio_prompt_cache_entries") >= 1
        assert value(after, "mlx_trio_prompt_cache_bytes") > 0
        # Held bytes count a shared span once: never more than the entries counted whole.
        assert value(after, "mlx_trio_prompt_cache_entry_bytes") >= value(
            after, "mlx_trio_prompt_cache_bytes")
        # No --prompt-cache-bytes: the engine's default, 45 % of the RAM less the weights.
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert 0.44 * ram < value(after, "mlx_trio_prompt_cache_max_bytes") <= 0.45 * ram


async def test_a_configured_prompt_cache_byte_limit_is_the_one_in_force(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, prompt_cache_bytes=5_000_000))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        metrics, _ = await scrape(client)
        assert value(metrics, "mlx_trio_prompt_cache_max_bytes") == 5_000_000


def test_each_runtime_has_its_own_registry():
    """Many apps in one process: each starts from zero, none sees another's counts."""
    from actors.metrics import RuntimeFigures
    from runtime.messages import EngineStats

    def figures():
        return RuntimeFigures(
            model_ready=True, requests_in_flight=0, requests_running=0, requests_waiting=0,
            kv_reserved_bytes=0, kv_budget_bytes=0, engine_restarts=0, stats=EngineStats(),
        )

    one, two = ServerMetrics(figures), ServerMetrics(figures)
    one.http_started()
    one.observe_response("/v1/chat/completions", 200)
    timing = RequestTiming(started=10.0, first_output=10.5, ended=12.5, completion_tokens=5,
                           queued=0.25)
    timing.outcome = "stop"
    one.observe_request(timing)
    text_one, text_two = one.render()[0].decode(), two.render()[0].decode()
    assert 'mlx_trio_http_responses_total{route="/v1/chat/completions",status="200"} 1.0' in text_one
    assert "mlx_trio_http_responses_total{" not in text_two
    assert "mlx_trio_time_to_first_token_seconds_sum 0.5" in text_one
    assert "mlx_trio_request_queue_seconds_sum 0.25" in text_one
    assert "mlx_trio_inter_token_latency_seconds_sum 0.5" in text_one  # 2 s over 4 gaps
    assert "mlx_trio_e2e_request_latency_seconds_sum 2.5" in text_one
    assert "mlx_trio_time_to_first_token_seconds_count 0.0" in text_two
