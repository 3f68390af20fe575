"""The server's Prometheus metrics: one ``CollectorRegistry`` per ``Runtime``.

``ServerMetrics`` owns the registry (per runtime, so tests can build many apps
in one process) and two kinds of metric:

* observed as things happen, with ``prometheus_client``'s own types: HTTP
  responses by endpoint (the route rule) and status and HTTP requests in
  progress (``observe_response``, ``http_started``; from the HTTP edge), each
  request's time to first output, mean inter-token latency, end-to-end
  latency and outcome (``observe_request``, from a leaving ``Session``'s
  ``RequestTiming``), model load times (``observe_load``, from the
  ModelLoader), embedding requests, inputs and tokens
  (``observe_embedding_request``, from the Embeddings actor) and the
  embedding model's forward passes (``observe_embedding_batch``, from its
  thread);
* read at scrape time by ``RuntimeCollector`` from the runtime's state: the
  Scheduler's queue and engine occupancy, the model's state and restarts,
  and the latest engine snapshot (``EngineStats``: steps, busy time, tokens,
  prompt-cache figures, aborts, and the step-time and batch-size histograms,
  whose bucket counts the engine keeps, exported as they are), and the
  prompt-cache policy's misses by reason and evictions.

The engine's counters start again from 0 when a new engine starts (a restart or
a model swap); Prometheus's ``rate()`` and ``increase()`` treat that as a
counter reset. ``render(accept)`` is what ``GET /metrics`` answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from actors.request_timing import RequestTiming
from runtime.embeddings import BatchFigures
from runtime.messages import BATCH_SIZE_BUCKETS, STEP_SECONDS_BUCKETS, EngineStats

PREFIX = "mlx_trio_"
LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0
)
INTER_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5
)
EMBEDDING_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
CLIENT_CLOSED = 499  # the status an answer never sent is counted under (nginx's)

# No ``*_created`` series: scrapers derive nothing from them, and they double the output.
prometheus_client.disable_created_metrics()


class ServerMetrics:
    """Every metric of one runtime, in its own registry."""

    def __init__(self, figures: Callable[[], RuntimeFigures]):
        """``figures()`` reads the runtime's state at scrape time."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_responses = Counter(
            PREFIX + "http_responses",
            "HTTP responses by endpoint (the route rule; 'unmatched' for unknown paths) and "
            f"status ({CLIENT_CLOSED}: the client left before an answer was sent)",
            ["route", "status"],
            registry=r,
        )
        self.http_in_progress = Gauge(
            PREFIX + "http_requests_in_progress",
            "HTTP requests being answered now (streams until their last chunk)",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Generation requests: from arrival (before the model lease, tokenization and "
            "queueing) to the first output the client is sent",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_seconds",
            "Generation requests that started: from tokenization until the engine took them "
            "into its batch (the queue for a slot and the KV budget, the admission window)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Generation requests with two or more generated tokens: mean time between them "
            "(first output to the end, over the tokens after the first)",
            buckets=INTER_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Generation requests that ended (finished or failed): from arrival to the end",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests_finished = Counter(
            PREFIX + "requests_finished",
            "Generation requests by outcome: the finish reason (stop, length, tool_calls), "
            "error, or abandoned (the client left first)",
            ["outcome"],
            registry=r,
        )
        self.model_load = Histogram(
            PREFIX + "model_load_seconds",
            "Model loads (start-up, restarts, swaps): from the engine's start to ready",
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.embedding_requests = Counter(
            PREFIX + "embedding_requests",
            "/v1/embeddings requests that reached the embedding model's queue, by outcome: ok, "
            "error (a 4xx or 5xx from the model's thread) or overloaded (429: the queue was full)",
            ["outcome"],
            registry=r,
        )
        self.embedding_inputs = Counter(
            PREFIX + "embedding_inputs", "Inputs embedded (ok requests)", registry=r
        )
        self.embedding_tokens = Counter(
            PREFIX + "embedding_tokens", "Tokens of the inputs embedded (usage.prompt_tokens)",
            registry=r,
        )
        self.embedding_batch_size = Histogram(
            PREFIX + "embedding_batch_size",
            "Inputs per forward pass of the embedding model (requests waiting together share one)",
            buckets=EMBEDDING_BATCH_BUCKETS,
            registry=r,
        )
        self.embedding_batch_seconds = Histogram(
            PREFIX + "embedding_batch_seconds",
            "Duration of the embedding model's forward passes",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(RuntimeCollector(figures))

    # -------------------------------------------------------------- recording

    def http_started(self) -> None:
        self.http_in_progress.inc()

    def observe_response(self, route: str, status: int) -> None:
        """An HTTP request ended (``http_started`` was called for it)."""
        self.http_in_progress.dec()
        self.http_responses.labels(route=route, status=str(status)).inc()

    def observe_request(self, timing: RequestTiming) -> None:
        if timing.time_to_first_output is not None:
            self.time_to_first_token.observe(timing.time_to_first_output)
        if timing.queued is not None:
            self.queue_time.observe(timing.queued)
        if timing.inter_token is not None:
            self.inter_token_latency.observe(timing.inter_token)
        if timing.duration is not None:
            self.e2e_latency.observe(timing.duration)
        self.requests_finished.labels(outcome=timing.outcome or "abandoned").inc()

    def observe_embedding_request(self, outcome: str, inputs: int, tokens: int) -> None:
        self.embedding_requests.labels(outcome=outcome).inc()
        self.embedding_inputs.inc(inputs)
        self.embedding_tokens.inc(tokens)

    def observe_embedding_batch(self, figures: BatchFigures) -> None:
        """One forward pass (called on the embedding thread: prometheus-client locks)."""
        self.embedding_batch_size.observe(figures.inputs)
        self.embedding_batch_seconds.observe(figures.seconds)

    def observe_load(self, seconds: float) -> None:
        self.model_load.observe(seconds)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition the scraper's ``Accept`` header asks for, and its content type
        (by default Prometheus's text format 0.0.4; OpenMetrics when asked)."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


# ------------------------------------------------------------ read at scrape


@attrs.frozen(kw_only=True)
class RuntimeFigures:
    """What ``RuntimeCollector`` reads: the runtime's state at one moment."""

    model_ready: bool
    requests_in_flight: int
    requests_running: int
    requests_waiting: int
    kv_reserved_bytes: int
    kv_budget_bytes: int
    engine_restarts: int
    preemptions: int = 0
    stats: EngineStats
    prompt_cache: dict = attrs.field(factory=dict)  # the prompt-cache policy's figures


class RuntimeCollector(Collector):
    """The runtime's state and the latest engine snapshot, as Prometheus metrics."""

    def __init__(self, figures: Callable[[], RuntimeFigures]):
        self._figures = figures

    def describe(self) -> list[Metric]:
        return list(self._metrics(None))

    def collect(self) -> Iterator[Metric]:
        return self._metrics(self._figures())

    def _metrics(self, f: RuntimeFigures | None) -> Iterator[Metric]:
        s: EngineStats = f.stats if f is not None else EngineStats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        def get(name: str) -> float:
            return getattr(f, name) if f is not None else 0

        yield gauge("model_ready", "1 while the model can take requests", get("model_ready"))
        yield gauge(
            "requests_in_flight",
            "Requests admitted and not finished: waiting for the engine or in it",
            get("requests_in_flight"),
        )
        yield gauge("requests_running", "Requests inside the engine", get("requests_running"))
        yield gauge(
            "requests_waiting",
            "Requests queued for a place in the engine (at most --max-queued-requests)",
            get("requests_waiting"),
        )
        yield gauge(
            "active_sequences",
            "Sequences the engine holds (in its batch or its admission window)",
            s.active_sequences,
        )
        yield gauge(
            "kv_reserved_bytes",
            "KV-cache bytes reserved by the requests in the engine (admission estimates)",
            get("kv_reserved_bytes"),
        )
        yield gauge("kv_budget_bytes", "The KV-cache budget (0: none)", get("kv_budget_bytes"))
        yield counter(
            "preemptions",
            "Sequences taken out of the engine as the KV budget ran short, each resumed "
            "from its tokens so far (--kv-reply-reserve-tokens)",
            get("preemptions"),
        )
        yield counter(
            "engine_restarts", "Engine restarts after a crash", get("engine_restarts")
        )
        yield counter("engine_steps", "Engine steps", s.steps)
        yield counter(
            "engine_prefill_steps", "Engine steps that processed prompt tokens", s.prefill_steps
        )
        yield counter(
            "engine_busy_seconds",
            "Time spent in engine steps (divided by wall time: how busy the engine is)",
            s.busy_seconds,
        )
        yield counter(
            "prompt_tokens",
            "Prompt tokens of the requests the engine started (cached ones included)",
            s.prompt_tokens,
        )
        yield counter(
            "prompt_tokens_computed",
            "Prompt tokens the model computed: neither from the prompt cache nor from the "
            "copy that a request's several choices share",
            s.prompt_tokens_computed,
        )
        yield counter(
            "generation_tokens",
            "Tokens generated (end-of-sequence tokens included, as usage counts them)",
            s.generated_tokens,
        )
        yield gauge("prompt_cache_entries", "KV caches in the prompt cache", s.prompt_cache_entries)
        cache = f.prompt_cache if f is not None else {}
        yield gauge(
            "prompt_cache_bytes",
            "Bytes the prompt cache holds: a KV span several entries share counted once "
            "(the byte limit applies to these)",
            cache.get("bytes", s.prompt_cache_bytes),
        )
        yield gauge(
            "prompt_cache_entry_bytes",
            "Bytes of the prompt cache's entries each counted whole, as if they shared nothing",
            cache.get("entry_bytes", s.prompt_cache_bytes),
        )
        yield counter(
            "prompt_cache_hits",
            "Requests whose prompt started from a prompt-cache entry",
            s.prompt_cache_hits,
        )
        yield counter(
            "prompt_cache_hit_tokens",
            "Prompt tokens taken from the prompt cache instead of computed",
            s.prompt_cache_cached_tokens,
        )
        misses = CounterMetricFamily(
            PREFIX + "prompt_cache_misses",
            "Requests that reused nothing from the prompt cache, by reason (docs/api.md)",
            labels=["reason"],
        )
        for reason, n in cache.get("misses", {}).items():
            misses.add_metric([reason], n)
        yield misses
        yield counter(
            "prompt_cache_evictions",
            "Prompt-cache entries evicted to keep --prompt-cache-size / --prompt-cache-bytes",
            cache.get("evictions", 0),
        )
        yield counter(
            "prompt_cache_evicted_bytes",
            "Bytes of the prompt-cache entries evicted",
            cache.get("evicted_bytes", 0),
        )
        yield gauge(
            "prompt_cache_max_bytes",
            "The prompt cache's byte limit, shared with the running sequences (0: none)",
            cache.get("max_bytes") or 0,
        )
        yield counter(
            "engine_aborts",
            "Running sequences removed because their client left or their deadline passed",
            s.aborts,
        )
        yield counter(
            "engine_abort_wait_ms",
            "Milliseconds those aborts waited in the engine's inbox",
            s.abort_wait_ms_total,
        )
        yield gauge("prompt_cache_disk_entries", "Prompt-cache entries on disk (--prompt-cache-dir)",
                    s.prompt_cache_disk_entries)
        yield gauge("prompt_cache_disk_bytes", "Bytes of the prompt-cache entries on disk",
                    s.prompt_cache_disk_bytes)
        yield counter("prompt_cache_disk_writes",
                      "Prompt-cache entries written to disk (system prompts, evicted entries)",
                      s.prompt_cache_disk_writes)
        yield counter("prompt_cache_disk_reads",
                      "Prompt-cache entries read back from disk for a request",
                      s.prompt_cache_disk_reads)
        yield counter("prompt_cache_disk_read_tokens",
                      "Prompt tokens of the entries read back from disk",
                      s.prompt_cache_disk_read_tokens)
        yield counter(
            "prompt_cache_aborted_prefills",
            "Prompts aborted while prefilled whose part computed so far went to the prompt "
            "cache (--aborted-prefill-min-tokens)",
            s.aborted_prefills_kept,
        )
        yield counter(
            "prompt_cache_aborted_prefill_tokens",
            "Prompt tokens those aborted prefills had computed, kept for a retry",
            s.aborted_prefill_tokens_kept,
        )
        yield gauge("decode_lanes",
                    "Decode batches stepping rows now: more than one when a long sequence "
                    "decodes apart from short ones (--decode-lane-padding)", s.decode_lanes)
        yield counter("decode_lanes_opened",
                      "Decode lanes opened beside the first since the engine's batch generator "
                      "was made", s.decode_lanes_opened)
        yield gauge("shared_kv_bytes",
                    "KV bytes that decoding sessions' shared prefixes held once save against "
                    "each session holding its own copy (--decode-shared-prefix-tokens); the "
                    "KV budget admits that much more", s.shared_kv_bytes)
        yield gauge("engine_abort_wait_ms_max", "The longest abort wait (ms)", s.abort_wait_ms_max)
        yield gauge(
            "engine_abort_wait_steps_max",
            "Most engine steps finished while an abort waited (1 by design)",
            s.abort_wait_steps_max,
        )
        yield _histogram(
            "engine_step_seconds",
            "Duration of the engine steps that ran sequences",
            STEP_SECONDS_BUCKETS,
            s.step_seconds_counts,
            s.step_seconds_sum,
        )
        yield _histogram(
            "engine_batch_size",
            "Sequences in the batch, per engine step that ran any",
            BATCH_SIZE_BUCKETS,
            s.batch_size_counts,
            s.batch_size_sum,
        )


def _histogram(
    name: str, doc: str, bounds: tuple[float, ...], counts: tuple[int, ...], total: float
) -> HistogramMetricFamily:
    """A histogram from per-bucket counts (one per bound, then +Inf), made cumulative."""
    counts = counts or (0,) * (len(bounds) + 1)
    buckets, running = [], 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else _bound(bound), running))
    return HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=total)


def _bound(value: float) -> str:
    return repr(float(value))
