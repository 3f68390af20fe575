"""Building a real ``EngineCore`` from mlx-lm parts, on the engine thread.

``make_engine_core(config, model_path)`` must be called on the thread that
will step the engine: it joins the distributed group if this process was
launched as one of its ranks, creates that thread's MLX stream, loads model
and tokenizer with ``mlx_lm.load`` (or its shard with ``sharded_load``) and
wires the batch generator (mlx-lm's ``BatchGenerator`` with one
``BatchSampler`` for all its rows, or ``SerialGenerator`` with per-request
samplers for a draft model, a quantized KV cache or a model whose cache cannot
be batched, ``VisionGenerator`` over mlx-vlm for a vision-language model,
loaded with ``mlx_vlm.load``), the constraints of structured outputs (``runtime.grammar``: the
model's tokenizer in llguidance's form is built here, once per load), the
prompt cache, the EOS stop automaton and the command source into an
``EngineCore``. ``load_tokenizer`` gives an engine process's
parent the tokenizer without the model.
"""

from __future__ import annotations

import functools
import gc
import logging
import time

import attrs

from runtime.batch_sampling import BatchSampler, make_batch_generator
from runtime.compiled_decode import compiled_layouts, install_compiled_decode, trace_batch_sizes
from runtime.compiled_decode_check import check_compiled_decode
from runtime.config import ServerConfig
from runtime.cuda_attention import in_place_chunk_limit, install_prefill_attention
from runtime.cuda_decode_attention import install_masked_decode
from runtime.cuda_graphs import cuda_graph_environment
from runtime.cuda_pool import keep_cuda_pool
from runtime.distributed import CommandExchange, GroupInfo, init_group, seed_all_ranks
from runtime.engine.commands import SharedCommands
from runtime.engine.core import EngineCore
from runtime.engine.disk_tier import DiskTier
from runtime.engine.pacing import (
    SHORT_PROMPT,
    PacedSteps,
    PrefillPacer,
    pacing_defaults,
    passes_cost_steps,
)
from runtime.engine.serial import SerialGenerator
from runtime.engine.vision_generator import VisionGenerator
from runtime.grammar import GrammarTokenizer, grammar_tokenizer
from runtime.grammar.backend import GrammarBackend, constraint_processor
from runtime.harmony import harmony_stop_ids, is_harmony_tokenizer
from runtime.held_prefix import install_prefix_holding, shared_prefix_min_saving
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.mixed_step import trace_paced_shapes
from runtime.mlx_environment import (
    bound_buffer_cache,
    default_decode_lane_padding,
    default_kv_budget,
    default_prefill_step_size,
    default_prompt_cache_budget,
    large_batch_bytes,
    prefill_score_budget,
    server_defaults,
    weights_bytes,
)
from runtime.mlx_lm_internals import (
    keep_freed_buffers_in_generate,
    sharded_load_on_the_default_stream,
)
from runtime.mlx_lm_prefill import coming_prefill, lone_prompt, size_prefill_group
from runtime.prompt_cache_disk import DiskPromptCache, model_fingerprint
from runtime.prompt_cache_store import PromptCacheStore
from runtime.sampling import build_logits_processors, build_sampler
from runtime.short_prompts_first import ShortPromptsFirst
from runtime.vacant_rows import install_row_reuse
from runtime.vision import vision_family

log = logging.getLogger(__name__)


def load_model(
    config: ServerConfig, model_path: str, group: GroupInfo | None = None
) -> LoadedModel:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    gc.collect()
    mx.clear_cache()
    tokenizer_config = _tokenizer_config(config)
    family = vision_family(model_path) if group is None else None
    processor = None
    if family is not None:
        from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer
        from mlx_vlm import load as load_vision_model

        log.info("loading vision-language model %s (%s) with mlx-vlm", model_path, family)
        if config.adapter_path is not None:
            log.warning("--adapter-path is not applied to a vision-language model")
        model, processor = load_vision_model(model_path)
        tokenizer = mlx_lm_load_tokenizer(model_path, tokenizer_config)
    elif group is not None:
        from mlx_lm.utils import sharded_load

        log.info("loading model %s, %s parallel over %d ranks", model_path, group.mode, group.size)
        with sharded_load_on_the_default_stream():
            model, tokenizer = sharded_load(
                model_path,
                pipeline_group=group.group if group.pipeline else None,
                tensor_group=None if group.pipeline else group.group,
                tokenizer_config=tokenizer_config,
                trust_remote_code=config.trust_remote_code,
            )
    else:
        log.info("loading model %s", model_path)
        model, tokenizer = load(
            model_path,
            adapter_path=config.adapter_path,
            tokenizer_config=tokenizer_config,
        )
    _finish_tokenizer(config, tokenizer)
    # A vision-language model's text half holds the KV cache and the config.
    text_model = model.language_model if family is not None else model
    batchable = family is None and all(hasattr(c, "merge") for c in make_prompt_cache(model))
    vocab_size = _vocab_size(text_model, tokenizer)
    weights = weights_bytes(model)
    info = ModelInfo(
        model_key=model_path,
        vocab_size=vocab_size,
        batchable=batchable,
        # Each rank holds 1/size of the KV cache (heads or layers split).
        kv_bytes_per_token=kv_bytes_per_token(text_model) // (group.size if group else 1),
        kv_budget=default_kv_budget(mx, weights),
        prompt_cache_budget=default_prompt_cache_budget(mx, weights),
        ranks=group.size if group else 1,
        parallel=group.mode if group else None,
        context_window=context_window(text_model, tokenizer, config.max_model_len),
        vision_family=family,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, processor=processor)


# Hugging Face tokenizers without a limit say int(1e30) (``VERY_LARGE_INTEGER``);
# anything this large is no real context length.
NO_TOKENIZER_LIMIT = 10**12
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_window(model, tokenizer, override: int | None = None) -> int | None:
    """Most tokens one sequence may hold: ``override`` (``--max-model-len``), else the
    model config's ``max_position_embeddings``, or the tokenizer's ``model_max_length``
    where that is smaller and real; ``None`` when neither says."""
    args = getattr(model, "args", None)
    sources = [args, getattr(args, "text_config", None)]
    from_model = None
    for source, key in ((s, k) for s in sources for k in POSITION_KEYS):
        value = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
        if isinstance(value, int) and value > 0:
            from_model = value
            break
    limit = getattr(tokenizer, "model_max_length", None)
    from_tokenizer = limit if isinstance(limit, int) and 0 < limit < NO_TOKENIZER_LIMIT else None
    known = [v for v in (from_model, from_tokenizer) if v is not None]
    window = min(known) if known else None
    if override is not None:
        if window is not None and override > window:
            log.warning(
                "--max-model-len %d is longer than the model's context window (%d tokens)",
                override,
                window,
            )
        return override
    return window


def _tokenizer_config(config: ServerConfig) -> dict:
    tokenizer_config = {"trust_remote_code": config.trust_remote_code}
    if config.chat_template:
        tokenizer_config["chat_template"] = config.chat_template
    return tokenizer_config


def _finish_tokenizer(config: ServerConfig, tokenizer) -> None:
    if config.use_default_chat_template and tokenizer.chat_template is None:
        tokenizer.chat_template = tokenizer.default_chat_template
    if is_harmony_tokenizer(tokenizer):  # gpt-oss: <|return|> and <|call|> end a reply
        for token_id in harmony_stop_ids(tokenizer):
            tokenizer.add_eos_token(token_id)


def load_tokenizer(config: ServerConfig, model_path: str, eos_token_ids) -> object:
    """The tokenizer ``load_model`` gives, without the model (an engine process's parent)."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    tokenizer = mlx_lm_load_tokenizer(model_path, _tokenizer_config(config))
    tokenizer.eos_token_ids = set(eos_token_ids)
    _finish_tokenizer(config, tokenizer)
    return tokenizer


def _attention_heads(model) -> int:
    """The model's query heads (its config's ``num_attention_heads``; 1 where it has none)."""
    return getattr(getattr(model, "args", None), "num_attention_heads", None) or 1


def kv_bytes_per_token(model) -> int:
    """layers x kv heads x head dim x 2 (K and V) x dtype bytes, from the model's config."""
    from mlx.utils import tree_flatten

    args = getattr(model, "args", None)
    layers = getattr(args, "num_hidden_layers", None) or len(getattr(model, "layers", []))
    heads = _attention_heads(model)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    hidden = getattr(args, "hidden_size", None) or 0
    head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads else 0)
    sizes = _float_types()
    leaves = tree_flatten(model.parameters())
    itemsize = next((sizes[v.dtype] for _, v in leaves if v.dtype in sizes), 2)
    return int(layers * kv_heads * head_dim * 2 * itemsize)


def _float_types() -> dict:
    import mlx.core as mx

    return {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}


def _vocab_size(model, tokenizer) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if size else len(tokenizer)


def make_engine_core(config: ServerConfig, model_path: str) -> EngineCore:
    import mlx.core as mx
    from mlx_lm.generate import make_stop_sequences

    # Before MLX builds its caches: no failing steps once they have missed "too often".
    on_cuda = mx.cuda.is_available()
    chosen = server_defaults()
    if on_cuda:  # Metal reads the same variables for its command buffers
        chosen += cuda_graph_environment(config.cuda_graphs)
    if chosen:
        log.debug("MLX settings for a server: %s", ", ".join(chosen))
    cache_limit = bound_buffer_cache(mx)
    if config.cuda_memory_pool == "keep" and on_cuda:
        log.info("CUDA memory pool keeps its memory: %s", keep_cuda_pool())
    if cache_limit is not None and config.prefill_buffers == "keep" and keep_freed_buffers_in_generate():
        log.debug("MLX free-buffer cache limited to %.1f GB, kept across prefill chunks",
                  cache_limit / 1e9)
    if config.prefill_step_size is None:
        config = attrs.evolve(config, prefill_step_size=default_prefill_step_size(mx))
        log.debug("prefill step size: %d tokens", config.prefill_step_size)
    unset = {name: value for name, value in pacing_defaults(on_cuda).items()
             if getattr(config, name) is None}
    config = attrs.evolve(config, **unset)
    if config.decode_lane_padding is None:
        config = attrs.evolve(config, decode_lane_padding=default_decode_lane_padding(mx))
    # Where a lone prompt's full chunks go to cuDNN on the grid of whole chunks, the
    # pacer keeps them on it (runtime.engine.pacing.aligned_chunk).
    on_grid = config.prefill_attention == "unfused" and install_prefill_attention(
        mx, full_chunk=config.prefill_step_size)
    if on_grid:
        log.debug("prefill attention: MLX's unfused path")
    if config.decode_attention != "mlx" and install_masked_decode(
            mx, config.decode_attention, min_bytes=config.decode_grouped_min_mib << 20):
        log.debug("a masked decode step's attention: %s", config.decode_attention)
    # The group, the load and every step on this thread (see runtime.distributed).
    group = init_group(config.distributed_backend, pipeline=config.pipeline)
    if group is None and config.pipeline:
        log.warning("--pipeline: this process is not part of a distributed group; ignored")
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        handle = load_model(config, model_path, group)
    tokenizer = handle.tokenizer
    commands = None
    serial = (config.draft_model is not None or config.kv_bits is not None
              or not handle.info.batchable)
    compiled = False
    if config.decode_path == "compiled" and group is None and not serial:
        with mx.stream(stream):  # on this thread, before the first step
            compiled = install_compiled_decode(handle.model) and check_compiled_decode(
                handle.model, handle.info.vocab_size, config.decode_concurrency)
        if compiled and not config.lazy_decode_traces:
            started = time.perf_counter()
            with mx.stream(stream):
                traces = trace_batch_sizes(handle.model, range(1, config.decode_concurrency + 1))
            log.info("compiled decode step traced for batch sizes 1-%d (%d traces, %.2f s)",
                     config.decode_concurrency, traces, time.perf_counter() - started)
            # The mixed pass too: a row joining the streams beside a paced prefill would
            # otherwise trace a new shape mid-stream.
            if config.chunk_pass == "shared" and on_cuda:
                with mx.stream(stream):
                    trace_paced_shapes(handle.model, config.decode_concurrency,
                                       config.paced_step_tokens, config.prefill_step_size)
    if group is not None:
        # Collectives on the batch's stream: in order with the model's own
        # (an all_sum on another stream could interleave with an in-flight step's).
        with mx.stream(stream):
            seed_all_ranks(group)
        commands = SharedCommands(CommandExchange(group, stream).share)
    xtc_special = list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids)

    grammar = _grammar_tokenizer(handle)
    batch_sampler = None
    if serial:
        if handle.info.vision_family is not None:
            log.info("%s: a vision-language model, served one request at a time", model_path)
        elif not handle.info.batchable:
            log.warning("%s: its KV cache cannot be batched; serving one at a time", model_path)
        new_batch_generator = _serial_generator_factory(config, handle, stream)
        # stream_generate has no row hook: per-request samplers, constraints as logits
        # processors (not with a draft model, whose drafts a processor cannot follow).
        constraint_factory = None
        if grammar is not None and config.draft_model is None:
            constraint_factory = functools.partial(_constraint_processor, grammar)
    else:
        # One pass for a step's decode and its paced chunk needs the compiled layers.
        chunk_pass = config.chunk_pass if compiled else "separate"
        every_layer_compiled = compiled and len(compiled_layouts(handle.model)) > 0 and all(
            hasattr(layer, "_compiled_decode") for layer in handle.model.layers)
        backend = GrammarBackend(grammar) if grammar is not None else None
        batch_sampler = BatchSampler(xtc_special_tokens=xtc_special, constraint_backend=backend)
        constraint_factory = backend.new_constraint if backend is not None else None

        def new_batch_generator():
            generator = make_batch_generator(
                handle.model,
                sampler=batch_sampler,
                completion_batch_size=config.decode_concurrency,
                prefill_batch_size=config.prompt_concurrency,
                prefill_step_size=config.prefill_step_size,
                stream=stream,
                chunk_pass=chunk_pass,
                queue_chunks=not config.wait_for_chunks,
                lane_padding=config.decode_lane_padding,
                chunk_parts=config.prefill_chunk_parts,
            )
            install_row_reuse(generator, config.decode_row_reuse_steps, large_batch_bytes(mx))
            if every_layer_compiled:  # the held prefix's attention is the compiled path's
                install_prefix_holding(generator, config.decode_shared_prefix_tokens,
                                       shared_prefix_min_saving(config, handle.info))
            return generator

    return EngineCore(
        handle,
        batch_generator_factory=new_batch_generator,
        # No limits here: the prompt-cache policy decides what to evict (EvictCache),
        # with rank 0's byte counts when distributed, for every rank alike.
        prompt_cache=PromptCacheStore(min_reuse_tokens=config.prompt_cache_min_reuse),
        prompt_cache_max_entries=config.prompt_cache_size,
        sampler_factory=lambda params: build_sampler(params, xtc_special),
        logits_processors_factory=build_logits_processors,
        batch_sampler=batch_sampler,
        constraint_factory=constraint_factory,
        insert_options=_vision_inputs if handle.info.vision_family is not None
        else _draft_tokens if config.draft_model is not None else None,
        stop_sequences=make_stop_sequences(tokenizer),
        commands=commands,
        # One request at a time: nothing for a window to gather.
        admission_window=0.0 if serial else config.admission_window_ms / 1000,
        burst_wait=0.0 if serial else config.burst_wait_ms / 1000,
        admission_batch=config.prompt_concurrency,
        admission_tokens=0 if serial else config.prefill_group_tokens,
        admission_limit=config.decode_concurrency,
        shared_prefill_min_tokens=0 if serial else config.shared_prefill_min_tokens,
        aborted_prefill_min_tokens=config.aborted_prefill_min_tokens,
        paced_steps=None
        if serial or (config.decode_stall_factor == 0 and not on_grid)
        else PacedSteps(
            PrefillPacer(config.decode_stall_factor, config.prefill_step_size,
                         ladder=config.chunk_pass == "shared",
                         floor_slack=config.prefill_floor_slack,
                         step_tokens=config.paced_step_tokens or None),
            coming_prefill,
            # A shared pass reads its chunk's attention in place up to a bound.
            chunk_limit=functools.partial(in_place_chunk_limit, mx,
                                          heads=_attention_heads(handle.model))
            if config.chunk_pass == "shared" else None,
            lone=lone_prompt if on_grid else None,
            tail=lone_prompt if passes_cost_steps(mx) else None,
        ),
        short_prompts_first=None if serial or config.short_prompts_join
        else ShortPromptsFirst(SHORT_PROMPT),
        prefill_group=None
        if serial
        else functools.partial(
            size_prefill_group,
            base=config.prompt_concurrency,
            token_budget=config.prefill_group_tokens or None,
            score_budget=prefill_score_budget(mx, _attention_heads(handle.model)),
            full_chunk=config.prefill_step_size,
            # Long prompts one at a time where a lone one's chunks take cuDNN's causal mask.
            alone_from=2 * config.prefill_step_size if on_grid else None,
        ),
        disk=_disk_tier(config, handle, model_path, distributed=group is not None),
    )


def _disk_tier(config: ServerConfig, handle: LoadedModel, model_path: str, *,
               distributed: bool) -> DiskTier | None:
    """The prompt cache's disk tier for this model, where ``--prompt-cache-dir`` asks
    for one and the model can have it."""
    if config.prompt_cache_dir is None:
        return None
    if config.prompt_cache_size == 0:
        log.info("--prompt-cache-dir: not used with --prompt-cache-size 0 (no prompt cache)")
        return None
    if distributed or handle.info.vision_family is not None:
        log.info("--prompt-cache-dir: not used for a %s model",
                 "distributed" if distributed else "vision-language")
        return None
    fingerprint = model_fingerprint(model_path, config.adapter_path)
    if fingerprint is None:
        log.warning("--prompt-cache-dir: the files of %s were not found; the prompt cache "
                    "stays in memory", model_path)
        return None
    try:
        disk = DiskPromptCache(config.prompt_cache_dir, config.prompt_cache_dir_bytes,
                               fingerprint)
    except OSError as exc:
        log.warning("--prompt-cache-dir %s cannot be used (%s); the prompt cache stays in "
                    "memory", config.prompt_cache_dir, exc)
        return None
    return DiskTier(disk)


def _grammar_tokenizer(handle: LoadedModel) -> GrammarTokenizer | None:
    """The tokenizer in llguidance's form, masks as wide as the logits; None if it cannot be.

    A few seconds for a 150k vocabulary: paid here, at load, not by the
    first constrained request. The request side refuses constraints for a
    tokenizer that is not a fast one, the case this returns None for.
    """
    began = time.perf_counter()
    try:
        built = grammar_tokenizer(handle.tokenizer, handle.info.vocab_size)
    except Exception:
        log.warning("%s: no structured outputs (the tokenizer cannot be read by llguidance)",
                    handle.info.model_key, exc_info=True)
        return None
    log.info("grammar tokenizer of %s: %d tokens in %.2f s",
             handle.info.model_key, built.vocab_size, time.perf_counter() - began)
    return built


def _constraint_processor(grammar: GrammarTokenizer, spec):
    return constraint_processor(spec.new_matcher(grammar), grammar)


def _draft_tokens(submit) -> dict:
    return {"num_draft_tokens": submit.num_draft_tokens}


def _vision_inputs(submit) -> dict:
    return {"vision_inputs": submit.vision}


def _serial_generator_factory(config: ServerConfig, handle: LoadedModel, stream):
    """Requests that cannot share a batch: speculative decoding, quantized KV cache.

    The draft model is loaded once, here; each generator (a new one after a
    failed step) serves with it.
    """
    import mlx.core as mx
    from mlx_lm import load

    if handle.info.vision_family is not None:
        if config.draft_model is not None or config.kv_bits is not None:
            log.warning("--draft-model and --kv-bits are not applied to a vision-language model")

        def new_vision_generator() -> VisionGenerator:
            return VisionGenerator(
                handle.model, handle.tokenizer, stream=stream,
                prefill_step_size=config.prefill_step_size,
            )

        return new_vision_generator

    draft_model = None
    if config.draft_model is not None:
        with mx.stream(stream):
            draft_model, draft_tokenizer = load(config.draft_model)
        if draft_tokenizer.vocab_size != handle.tokenizer.vocab_size:
            log.warning("the draft model's vocabulary differs from the model's")

    def new_serial_generator() -> SerialGenerator:
        return SerialGenerator(
            handle.model,
            handle.tokenizer,
            draft_model=draft_model,
            stream=stream,
            prefill_step_size=config.prefill_step_size,
            num_draft_tokens=config.num_draft_tokens,
            kv_bits=config.kv_bits,
            kv_group_size=config.kv_group_size,
            quantized_kv_start=config.quantized_kv_start,
        )

    return new_serial_generator
