"""The one configuration type behind both ways to start the server.

``ServerConfig`` is an attrs class whose every field is declared with
``setting(...)`` (``runtime.settings``): its metadata (a ``Setting``) is the one statement of the
field's flag, environment variable, help, group, default, value format and bounds.
Everything else reads it: the command line (``api.cli``: mlx_lm.server's
flags, same names and defaults, plus ours, listed by group), ``MLX_TRIO_<NAME>``
environment variables (``config_from_env``, for ``hypercorn api:app --worker-class
trio``), the attrs validators made from the bounds, and the settings tables of
docs/configuration.md (``api.cli --markdown``).

Text values (flags, variables) are parsed by the setting's ``TextFormat``
(``"4GB"`` is a size, ``"a,b"`` a list); values are structured by cattrs; a bad
value raises ``ConfigError`` naming the setting (``cattrs.transform_error``).
"""

import os
from collections.abc import Mapping
from typing import Any

import attrs

from runtime.distributed import BACKENDS
from runtime.prompt_cache_settings import PromptCacheSettings
from runtime.settings import (
    BATCHING,
    DISTRIBUTED,
    DURATION,
    EMBEDDINGS,
    LIMITS,
    MODEL,
    SAMPLING,
    SECURITY,
    SERVER,
    SIZE,
    STORED,
    Setting,
    Settings,
    complete_settings,
    setting,
)
from runtime.settings import ConfigError as ConfigError  # raised by config_from_*

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENGINE_MODES = ("process", "thread")


# This module has no ``from __future__ import annotations``: ``complete_settings``
# reads the fields' types (to pick their text format), so they must be real types.
@attrs.frozen(kw_only=True, field_transformer=complete_settings)
class ServerConfig(PromptCacheSettings):
    """Every setting of the server, one field each; the prompt cache's and the Advanced
    tuning ones are declared in ``runtime.prompt_cache_settings`` and
    ``runtime.tuning_settings`` and inherited (``PromptCacheSettings`` extends
    ``TuningSettings``), each listed in its group."""

    model: str | None = setting(
        None,
        help="path or Hugging Face repo of the default MLX model",
        notes="Loaded at start; requests may name others, see "
        "[api.md](api.md#model-selection). With none, the embedded demo model "
        "`demo_model/mlx-trio-demo` is served as `mlx-trio-demo` (see "
        "[demo-model.md](demo-model.md)); only if its weights are missing from the install, "
        "a tiny model with random weights is built (once) under "
        "`$XDG_CACHE_HOME/mlx-trio-server/mlx-trio-tiny-random` (default `~/.cache/...`) and "
        "served as `mlx-trio-tiny-random`, whose output is noise.",
        group=MODEL,
    )
    adapter_path: str | None = setting(
        None, help="LoRA adapter for the default model, passed to mlx_lm.load", group=MODEL
    )
    draft_model: str | None = setting(
        None,
        help="draft model for speculative decoding",
        notes="When set, requests are served one at a time (serial mode, through "
        "`stream_generate`), not batched.",
        group=MODEL,
    )
    num_draft_tokens: int = setting(
        3,
        help="draft tokens per step with a draft model; a request's num_draft_tokens overrides it",
        group=MODEL,
    )
    trust_remote_code: bool = setting(
        False, help="trust remote code when loading the tokenizer", group=MODEL
    )
    chat_template: str = setting(
        "", help="a chat template that replaces the tokenizer's, when not empty", group=MODEL
    )
    use_default_chat_template: bool = setting(
        False, help="use the tokenizer's default chat template when it has none", group=MODEL
    )
    max_model_len: int | None = setting(
        None,
        help="the context window: most tokens (prompt + generated) one sequence may hold",
        above=0,
        ours=True,
        default_text="the model's",
        notes="The model's is its config's `max_position_embeddings`, or its tokenizer's "
        "`model_max_length` where that is smaller (and not the 'no limit' sentinel). A longer "
        "prompt (or one that leaves no room for a token) is a 400 `context_length_exceeded`; "
        "`max_tokens` is lowered to what the window leaves "
        "([api.md](api.md#the-context-window)). As vLLM names it.",
        group=MODEL,
    )
    allowed_models: tuple[str, ...] = setting(
        (),
        help="models (names, local paths or Hugging Face repos) that requests may name besides "
        "the served one; `*`: any model on this machine",
        ours=True,
        repeatable=True,
        default_text="none: only the served model",
        notes="The served model, its `--adapter-path` and `--draft-model` are always allowed. "
        "Applies to a request's `model`, `adapters` and `draft_model`; anything else is a 404 "
        "before anything is loaded. `GET /v1/models` lists exactly what is allowed. See "
        "[api.md](api.md#model-selection).",
        group=MODEL,
    )
    models_dir: str | None = setting(
        None,
        help="a folder of models: requests may name any model directory inside it, by its path "
        "or by its path relative to the folder",
        ours=True,
        notes="Listed by `GET /v1/models` (directories with a `config.json`, up to two levels "
        "deep, e.g. `org/model`).",
        group=MODEL,
    )
    host: str = setting(
        "127.0.0.1",
        help="address the command binds",
        notes="Not used under `hypercorn api:app` (use `--bind`).",
        group=SERVER,
    )
    port: int = setting(
        8080, help="port the command binds", notes="Not used under `hypercorn api:app`.",
        group=SERVER,
    )
    allowed_origins: tuple[str, ...] = setting(
        ("*",),
        help="comma-separated CORS origins",
        notes="With `*`, `Access-Control-Allow-Origin: *`; otherwise a listed request "
        "`Origin` is echoed.",
        group=SERVER,
    )
    log_level: str = setting(
        "INFO",
        help="logging level",
        choices=LOG_LEVELS,
        converter=str.upper,
        notes="The flag takes upper case only; the variable any case.",
        group=SERVER,
    )
    engine_mode: str = setting(
        "process",
        help="run the engine in a child process (default) or on a thread of the server process",
        choices=ENGINE_MODES,
        ours=True,
        notes="`process`: each model's engine runs in a child process of the server "
        "(`runtime/engine/process.py`): a crash of native code there (a segfault in MLX) is an "
        "engine crash that restarts, not the end of the server, and a swapped-out model's "
        "memory goes back to the system with its process. `thread`: the engine runs on a "
        "thread of the server process. A distributed launch always uses `thread`.",
        group=SERVER,
    )
    shutdown_grace: float = setting(
        8.0,
        help="seconds open requests get to finish after SIGTERM or SIGINT; then each ends "
        "properly (finish_reason \"abort\", an error event and [DONE] for a stream, 503 for a "
        "waiting request)",
        minimum=0,
        ours=True,
        notes="`mlx-trio-server` gives Hypercorn a graceful timeout 2 s longer, so that no "
        "stream is cut. Under `hypercorn api:app` see "
        "[operations.md](operations.md#signals-and-shutdown).",
        group=SERVER,
    )
    temp: float = setting(
        0.0, help="default temperature for requests that do not send one", group=SAMPLING
    )
    top_p: float = setting(1.0, help="default top_p", group=SAMPLING)
    top_k: int = setting(0, help="default top_k (0 is off)", group=SAMPLING)
    min_p: float = setting(0.0, help="default min_p", group=SAMPLING)
    max_tokens: int = setting(
        512, help="default max_tokens", above=0, notes="Requests may ask for more.", group=SAMPLING
    )
    chat_template_args: dict[str, Any] = setting(
        factory=dict,
        help='JSON object of extra chat-template arguments, e.g. {"enable_thinking": false}',
        notes="A request's `chat_template_kwargs` override it key by key.",
        group=SAMPLING,
    )
    decode_concurrency: int = setting(
        32, help="sequences decoded together (BatchGenerator completion_batch_size)", above=0,
        group=BATCHING,
    )
    prompt_concurrency: int = setting(
        8,
        help="prompts prefilled together (BatchGenerator prefill_batch_size)",
        above=0,
        notes="The Scheduler lets `decode_concurrency + prompt_concurrency` requests into the "
        "engine at once.",
        group=BATCHING,
    )
    prefill_step_size: int | None = setting(
        None,
        help="prompt tokens per prefill step",
        above=0,
        default_text="2048 on a GPU, 512 on the CPU",
        notes="On a GPU the default is mlx-lm's. On the CPU, MLX's attention computes every "
        "chunk's scores in full, the causally masked ones included, so smaller chunks do less "
        "work: a lone 3,120-token prompt prefilled 1.3x as fast in chunks of 512 as in chunks "
        "of 2,048 ([performance.md](performance.md#cpu-prefill-step-size)). Lower it where one "
        "chunk's attention needs more memory than the machine has: its scores grow with the "
        "chunk times the prompt's length.",
        group=BATCHING,
    )
    max_queued_requests: int = setting(
        256,
        help="requests that may wait in the Scheduler when the engine is full; beyond that a "
        "request gets 429",
        above=0,
        ours=True,
        notes="The 429 carries `Retry-After: 1`.",
        group=LIMITS,
    )
    max_request_bytes: int = setting(
        8 * 2**20,
        help="largest request body in bytes; a larger one gets 413",
        above=0,
        ours=True,
        default_text="8388608 (8 MiB)",
        group=LIMITS,
    )
    request_timeout: float | None = setting(
        None,
        help="seconds after which a request is aborted: it finishes with finish_reason "
        "\"length\"; a request's timeout may only shorten it",
        above=0,
        ours=True,
        group=LIMITS,
    )
    kv_cache_budget_bytes: int | None = setting(
        None,
        help="KV-cache bytes the sequences in the engine may reserve, a size such as 8GB",
        format=SIZE.or_none(),
        above=0,
        ours=True,
        default_text="35 % of the accelerator's memory less the weights (CPU: of the RAM)",
        notes="A request reserves bytes per token times its prompt tokens plus `max_tokens`, "
        "or plus `--kv-reply-reserve-tokens` where it can be preempted (grown as its reply "
        "fills them). A prompt that cannot fit the budget gets 413, `max_tokens` is lowered "
        "to what it leaves, and a request waits until what it reserves fits. The default "
        "applies only when the model's bytes per token are known (non-zero). It leaves room "
        "for the prompt cache, the steps' activations, MLX's freed buffers and a copy of a "
        "decoding batch smaller than an eighth of the memory (mlx-lm copies a batch whenever "
        "a sequence joins, leaves or grows past a block; a larger batch is copied a layer at "
        "a time). On an 80 GB H100, 50GB ran sixteen 24k-token agent sessions out of memory "
        "in their first turns; raise it only with all of these in mind.",
        group=LIMITS,
    )
    kv_reply_reserve_tokens: int = setting(
        4096,
        help="reply tokens a request reserves of the KV budget as it starts, grown by as many "
        "each time its reply fills them; 0 reserves max_tokens whole",
        minimum=0,
        ours=True,
        notes="Coding agents ask for 32,000 or more tokens a reply and use a few thousand at "
        "most, so reserving `max_tokens` whole holds most of the budget idle and makes their "
        "sessions wait. When replies outgrow the budget, the most recently started requests "
        "leave the engine and resume at the head of the queue from their tokens so far, the "
        "client seeing one stream (requests with n > 1, a constraint, images or a seed "
        "reserve `max_tokens` whole and are never preempted). Lower it where replies are "
        "short and many sessions share the budget; 0 where preemption is unwanted "
        "([agents.md](agents.md#context-windows)).",
        group=LIMITS,
    )
    max_choices: int = setting(
        8,
        help="largest n a request may ask for (choices generated from one prompt)",
        above=0,
        ours=True,
        notes="Run as n sequences; the prompt once ([api.md](api.md#several-choices-n)).",
        group=LIMITS,
    )
    image_max_bytes: int = setting(
        8 * 2**20,
        help="largest image in a chat request's image_url part, in bytes (a data: URL decoded, "
        "or a fetched image); a larger one gets 400",
        above=0,
        ours=True,
        default_text="8388608 (8 MiB)",
        notes="A data: URL also counts towards `--max-request-bytes`. Vision-language models "
        "only ([models.md](models.md#vision-language-models)).",
        group=LIMITS,
    )
    image_max_pixels: int = setting(
        4096 * 4096,
        help="most pixels (width x height) an image may have, read from its header before it "
        "is decoded; a larger one gets 400",
        above=0,
        ours=True,
        default_text="16777216 (4096 x 4096)",
        group=LIMITS,
    )
    image_fetch_timeout: float = setting(
        10.0,
        help="seconds an http(s) image may take to fetch (with --allow-image-urls); a slower "
        "one gets 400",
        above=0,
        ours=True,
        group=LIMITS,
    )
    responses_store_path: str | None = setting(
        None,
        help="SQLite file of stored responses (made, with its folder, if missing); `:memory:` "
        "keeps them in memory only, lost on restart",
        ours=True,
        default_text="$XDG_DATA_HOME/mlx-trio-server/responses.sqlite3 (~/.local/share/...)",
        notes="See [operations.md](operations.md#stored-responses).",
        group=STORED,
    )
    responses_store_bytes: int | None = setting(
        256 * 10**6,
        help="byte limit of stored responses (compressed, as stored), a size such as 1GB; the "
        "least recently used go first (none: no limit)",
        format=SIZE.or_none(), above=0, ours=True, default_text="256M", group=STORED,
    )
    responses_store_max_age: float | None = setting(
        30 * 86400.0,
        help="how long a stored response is kept after it is made, a duration such as 30d, 12h "
        "or 3600 (seconds) (none: no limit)",
        format=DURATION.or_none(), above=0, ours=True, default_text="30d", group=STORED,
    )
    embedding_model: str | None = setting(
        None,
        help="path or Hugging Face repo of an embedding model to serve at /v1/embeddings "
        "(none: no embeddings)",
        ours=True,
        notes="Loaded at start by [mlx-embeddings](https://github.com/Blaizzy/mlx-embeddings) "
        "(install the `embeddings` extra), on a thread of its own beside the chat model's "
        "engine; requests name it by this value. The families it can serve are listed in "
        "[models.md](models.md#embeddings). One that cannot be loaded ends `mlx-trio-server` "
        "(under `hypercorn api:app`: `/health` and `/v1/embeddings` answer 503 naming why).",
        group=EMBEDDINGS,
    )
    embedding_batch_size: int = setting(
        32,
        help="most inputs in one forward pass of the embedding model (inputs of requests "
        "that wait together share passes)",
        above=0,
        ours=True,
        group=EMBEDDINGS,
    )
    embedding_batch_tokens: int = setting(
        16384,
        help="most tokens in one forward pass of the embedding model, counted as inputs "
        "times the longest one (padding included)",
        above=0,
        ours=True,
        notes="An input longer than this still runs, alone in its pass.",
        group=EMBEDDINGS,
    )
    embedding_max_inputs: int = setting(
        2048,
        help="most inputs one /v1/embeddings request may send (more: 400)",
        above=0,
        ours=True,
        notes="2048 is OpenAI's limit. Requests waiting for the embedding model are bounded "
        "by `--max-queued-requests` (beyond it: 429).",
        group=EMBEDDINGS,
    )
    embedding_matryoshka: bool = setting(
        False,
        help="the embedding model was trained for shortened vectors (Matryoshka): a request's "
        "`dimensions` keeps that many leading components, normalised again",
        ours=True,
        notes="Without it, `dimensions` other than the model's own size is a 400: cutting "
        "a vector the model was not trained to have cut gives a worse embedding, silently.",
        group=EMBEDDINGS,
    )
    api_key: tuple[str, ...] = setting(
        (),
        help="API key that clients must send, as `Authorization: Bearer KEY` or `x-api-key: "
        "KEY`; repeat the flag or separate keys with commas (none: no authentication)",
        ours=True,
        repeatable=True,
        secret=True,
        default_text="none",
        notes="Checked on every API route; a missing or wrong key is a 401 (`invalid_api_key`; "
        "Anthropic's error shape on `/v1/messages`). `/health`, the chat page (`/`, "
        "`/assets/`) and CORS preflights stay open; `/metrics` too unless "
        "`--metrics-require-key`. See [operations.md](operations.md#authentication).",
        group=SECURITY,
    )
    api_key_file: str | None = setting(
        None,
        help="file of API keys, one per line (blank lines and lines starting with # are "
        "skipped); adds to --api-key",
        ours=True,
        notes="Read once at start-up; one that cannot be read stops the start.", group=SECURITY,
    )
    metrics_require_key: bool = setting(
        False, help="/metrics also requires an API key (when keys are set)", ours=True,
        group=SECURITY,
    )
    allow_image_urls: bool = setting(
        False,
        help="fetch http(s) URLs of chat image_url parts (off: data: URLs only)",
        ours=True,
        notes="The server then makes requests to addresses that clients choose: turn it on "
        "only where that is safe. Fetches are bounded by `--image-max-bytes` and "
        "`--image-fetch-timeout`.",
        group=SECURITY,
    )
    distributed_backend: str = setting(
        "any",
        help="mx.distributed backend when started by mlx.launch (match mlx.launch --backend)",
        choices=BACKENDS,
        ours=True,
        notes="Ignored when not started by a launcher.",
        group=DISTRIBUTED,
    )
    distributed_timeout: float = setting(
        60.0,
        help="seconds without an engine step or heartbeat before rank 0 reports the group lost "
        "(and a follower rank, not hearing from rank 0, leaves)",
        above=0,
        ours=True,
        notes="A rank died or hung: `/health` 503, requests 503. Keep it above your slowest "
        "single step (a long prefill chunk). A rank whose launcher is gone leaves within a "
        "second, whatever this is ([distributed.md](distributed.md#failures)).",
        group=DISTRIBUTED,
    )
    pipeline: bool = setting(
        False,
        help="distributed serving (started by mlx.launch): split the model's layers across the "
        "ranks (pipeline parallel) instead of sharding every layer (tensor parallel)",
        notes="Outside a distributed launch, start-up fails if set. See "
        "[distributed.md](distributed.md).",
        group=DISTRIBUTED,
    )


_SETTINGS = Settings(ServerConfig)
SETTINGS: tuple[Setting, ...] = _SETTINGS.all


def setting_of(name: str) -> Setting:
    return _SETTINGS.by_name[name]


def flag(name: str) -> str:
    return _SETTINGS.by_name[name].flag


def config_from_mapping(values: Mapping[str, Any]) -> ServerConfig:
    """``ServerConfig`` from setting names to values; a string is parsed as its flag's text."""
    return _SETTINGS.from_mapping(values)


def config_from_env(environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Read ``MLX_TRIO_<SETTING>`` variables (e.g. ``MLX_TRIO_MAX_TOKENS=256``)."""
    return _SETTINGS.from_env(os.environ if environ is None else environ)
