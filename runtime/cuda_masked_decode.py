"""A decode step's attention under a boolean mask as one CUDA kernel of our own, and its reduction.

Owns ``masked_decode_attention``: a layer's queries (one a row), its KV cache's key and
value buffers and mlx-lm's boolean mask (rows, 1, 1, keys) in; the attention (rows,
query heads, 1, head dim) out. ``runtime.cuda_decode_attention.decode_attention`` calls
it under ``--decode-attention kernel``; ``kernel_applies`` says which calls it takes.
Also ``held_prefix_decode_attention``, the same over a layer holding its rows' shared
prefix once (``runtime.held_prefix``): the prefix's keys and values (one row) besides,
and ``held_kernel_applies``.

Why a kernel: a decoding batch of several rows is padded on the left to one length and
masked, MLX's CUDA kernel for one query a row takes no mask, and MLX's fallback computes
such a layer's attention as several operations (a scale, two matrix products, the mask,
a softmax) where one row's attention is one kernel. A decode step of 2-16 rows is then
bound by the host's cost per operation (docs/performance.md, "H100: a masked decode
step's route by shape"). Here a layer's masked attention is two launches, split over the
keys (flash decoding): the first gives each block of ``KEYS_PER_SPLIT`` keys, per row and
KV head, its running maximum, sum and weighted values for each of that KV head's query
heads, the second merges the blocks. The keys and values are read once per KV head, a
few lanes a key (``elements_per_lane``); a block wholly masked (a row's left padding)
is not read, and in the others a masked key is read with the rest, so that no load waits
for the mask's answer. The buffers are read in place up to the mask's length, so nothing is
copied or padded first. Over a held prefix the first launch's grid is the prefix's
blocks and then each row's own, the rows of one prefix block side by side so that its
keys come from memory once and from the L2 cache for the other rows: the operations
this replaces (``runtime.shared_prefix_attention``, about 30 a layer) made four
12k-token sessions' decode step on an H100 10 ms slower than our kernel over each row
holding the prefix.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

# Keys one block of the first kernel reads: a 12k-token row makes 47 blocks per KV head.
KEYS_PER_SPLIT = 256
# Threads a block of the first kernel runs (four warps), and keys each group of lanes
# (one key's reader, ``elements_per_lane``) loads at once.
THREADS = 128
KEYS_PER_LOAD = 2
# Elements of a key a lane reads at most (16 half-precision values: two 16-byte loads),
# and the query elements a lane keeps in registers per key at most (its query heads'
# slices, and as many running sums).
MOST_ELEMENTS_PER_LANE = 16
QUERY_ELEMENTS_PER_LANE = 32
HEAD_DIMS = (64, 128, 256)
# Query heads per KV head the first kernel keeps in registers at most.
MOST_QUERIES_PER_KV_HEAD = 8

# Pack: a lane's EPL elements of one head's vector, loaded at once where they lie
# contiguous and aligned; else one by one along their stride.
_HEADER = """
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T x[N];
};

template <typename T, int N>
__device__ inline Pack<T, N> load_pack(const T* at, int64_t step, bool packed) {
    if (packed) {
        return *reinterpret_cast<const Pack<T, N>*>(at);
    }
    Pack<T, N> out;
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        out.x[i] = at[i * step];
    }
    return out;
}

template <typename T, int N>
__device__ inline bool packs(const T* base, const mlx::core::cu::Strides& strides) {
    return strides[3] == 1 && strides[0] % N == 0 && strides[1] % N == 0
        && strides[2] % N == 0
        && reinterpret_cast<size_t>(base) % sizeof(Pack<T, N>) == 0;
}
"""

# The first kernel's blocks: which row, KV head and keys a block reads. A row's own
# keys: a block per split of them, each row's splits together, read under the mask.
_OWN_BLOCKS = """
    const int split = blockIdx.x;
    const int splits = gridDim.x;
    const int kv_head = blockIdx.y;
    const int row = blockIdx.z;
    const bool masked = true;
    const int first = split * KEYS_PER_SPLIT;
    const int last = min(first + KEYS_PER_SPLIT, mask_shape[3]);
    const T* key_base = keys + row * keys_strides[0] + kv_head * keys_strides[1];
    const T* value_base = values + row * values_strides[0] + kv_head * values_strides[1];
    const int64_t key_step = keys_strides[2], key_element = keys_strides[3];
    const int64_t value_step = values_strides[2], value_element = values_strides[3];
    const bool keys_packed = packs<T, EPL>(keys, keys_strides);
    const bool values_packed = packs<T, EPL>(values, values_strides);
"""

# A prefix held once for all rows (runtime.held_prefix), then each row's own keys: the
# prefix's splits first, every row's block of one split next to the others' (the rows
# vary fastest, so a split's keys are read from memory once and from the L2 cache by
# the other rows' blocks, which run beside it), the rows' own splits after them.
_HELD_BLOCKS = """
    const int rows = queries_shape[0];
    const int row = blockIdx.x % rows;
    const int split = blockIdx.x / rows;
    const int splits = gridDim.x / rows;
    const int kv_head = blockIdx.y;
    const int n_prefix = prefix_keys_shape[2];
    const int prefix_splits = (n_prefix + KEYS_PER_SPLIT - 1) / KEYS_PER_SPLIT;
    const bool masked = split >= prefix_splits;
    const int first = (masked ? split - prefix_splits : split) * KEYS_PER_SPLIT;
    const int last = min(first + KEYS_PER_SPLIT, masked ? mask_shape[3] : n_prefix);
    const T* key_base = masked
        ? keys + row * keys_strides[0] + kv_head * keys_strides[1]
        : prefix_keys + kv_head * prefix_keys_strides[1];
    const T* value_base = masked
        ? values + row * values_strides[0] + kv_head * values_strides[1]
        : prefix_values + kv_head * prefix_values_strides[1];
    const int64_t key_step = masked ? keys_strides[2] : prefix_keys_strides[2];
    const int64_t key_element = masked ? keys_strides[3] : prefix_keys_strides[3];
    const int64_t value_step = masked ? values_strides[2] : prefix_values_strides[2];
    const int64_t value_element = masked ? values_strides[3] : prefix_values_strides[3];
    const bool keys_packed = masked ? packs<T, EPL>(keys, keys_strides)
                                    : packs<T, EPL>(prefix_keys, prefix_keys_strides);
    const bool values_packed = masked ? packs<T, EPL>(values, values_strides)
                                      : packs<T, EPL>(prefix_values, prefix_values_strides);
"""

# The first kernel after its blocks' setup: a block's running maximum, sum and weighted
# values over its keys, for each query head of its KV head.
_SPLIT_SOURCE = """
    constexpr int LANES_PER_KEY = D / EPL;
    constexpr int WARPS = THREADS / 32;
    constexpr int GROUPS = THREADS / LANES_PER_KEY;
    using P = Pack<T, EPL>;
    const float scale_log2 = __int_as_float(SCALE_BITS) * 1.44269504089f;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int part = lane % LANES_PER_KEY;
    const int group = threadIdx.x / LANES_PER_KEY;
    const int q_heads = keys_shape[1] * REP;
    const bool queries_packed = packs<T, EPL>(queries, queries_strides);

    float q[REP][EPL];
    float top[REP], total[REP], acc[REP][EPL];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        const P p = load_pack<T, EPL>(
            queries + row * queries_strides[0] + (kv_head * REP + r) * queries_strides[1]
            + part * EPL * queries_strides[3], queries_strides[3], queries_packed);
        #pragma unroll
        for (int i = 0; i < EPL; ++i) {
            q[r][i] = scale_log2 * static_cast<float>(p.x[i]);
            acc[r][i] = 0.f;
        }
        top[r] = -1e30f;
        total[r] = 0.f;
    }
    const bool* live_at = mask + row * mask_strides[0];
    const int64_t live_step = mask_strides[3];
    const T* key_at = key_base + part * EPL * key_element;
    const T* value_at = value_base + part * EPL * value_element;

    // A block whose keys are all masked (a row's left padding) reads none of them.
    bool any_live = !masked;
    for (int i = first + threadIdx.x; masked && i < last; i += THREADS) {
        any_live = any_live || live_at[i * live_step];
    }
    const int end = __syncthreads_or(any_live) ? last : first;
    // A group of LANES_PER_KEY lanes reads one key (each lane EPL elements of it), the
    // block's groups KEYS_PER_LOAD keys each at once: the mask, key and value loads of
    // a pass are all in flight together (none waits for another's answer). The passes
    // are the same for every lane, as the shuffles below need.
    for (int base = first; base < end; base += GROUPS * KEYS_PER_LOAD) {
        P kp[KEYS_PER_LOAD] = {};
        P vp[KEYS_PER_LOAD] = {};
        bool live[KEYS_PER_LOAD];
        #pragma unroll
        for (int u = 0; u < KEYS_PER_LOAD; ++u) {
            const int i = base + group + u * GROUPS;
            live[u] = false;
            if (i < end) {
                live[u] = !masked || live_at[i * live_step];
                kp[u] = load_pack<T, EPL>(key_at + i * key_step, key_element, keys_packed);
                vp[u] = load_pack<T, EPL>(value_at + i * value_step, value_element,
                                          values_packed);
            }
        }
        float score[KEYS_PER_LOAD][REP];
        #pragma unroll
        for (int u = 0; u < KEYS_PER_LOAD; ++u) {
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                float dot = 0.f;
                #pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    dot += q[r][i] * static_cast<float>(kp[u].x[i]);
                }
                #pragma unroll
                for (int offset = LANES_PER_KEY / 2; offset > 0; offset >>= 1) {
                    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
                }
                score[u][r] = live[u] ? dot : -1e30f;
            }
        }
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            float most = top[r];
            #pragma unroll
            for (int u = 0; u < KEYS_PER_LOAD; ++u) {
                most = fmaxf(most, score[u][r]);
            }
            const float keep = exp2f(top[r] - most);
            total[r] *= keep;
            #pragma unroll
            for (int i = 0; i < EPL; ++i) {
                acc[r][i] *= keep;
            }
            top[r] = most;
            #pragma unroll
            for (int u = 0; u < KEYS_PER_LOAD; ++u) {
                if (live[u]) {  // a masked key's values are never summed, whatever they hold
                    const float weight = exp2f(score[u][r] - most);
                    total[r] += weight;
                    #pragma unroll
                    for (int i = 0; i < EPL; ++i) {
                        acc[r][i] += weight * static_cast<float>(vp[u].x[i]);
                    }
                }
            }
        }
    }

    // A warp's groups merged into each of its groups (lanes LANES_PER_KEY apart).
    #pragma unroll
    for (int offset = LANES_PER_KEY; offset < 32; offset <<= 1) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            const float other_top = __shfl_xor_sync(0xffffffffu, top[r], offset);
            const float other_total = __shfl_xor_sync(0xffffffffu, total[r], offset);
            const float most = fmaxf(top[r], other_top);
            const float mine = exp2f(top[r] - most);
            const float theirs = exp2f(other_top - most);
            total[r] = total[r] * mine + other_total * theirs;
            #pragma unroll
            for (int i = 0; i < EPL; ++i) {
                const float other = __shfl_xor_sync(0xffffffffu, acc[r][i], offset);
                acc[r][i] = acc[r][i] * mine + other * theirs;
            }
            top[r] = most;
        }
    }

    __shared__ float warp_top[WARPS][REP];
    __shared__ float warp_total[WARPS][REP];
    __shared__ float warp_acc[WARPS][REP][D];
    if (lane < LANES_PER_KEY) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            if (lane == 0) {
                warp_top[warp][r] = top[r];
                warp_total[warp][r] = total[r];
            }
            #pragma unroll
            for (int i = 0; i < EPL; ++i) {
                warp_acc[warp][r][part * EPL + i] = acc[r][i];
            }
        }
    }
    __syncthreads();
    for (int at = threadIdx.x; at < REP * D; at += THREADS) {
        const int r = at / D;
        const int d = at % D;
        float most = -1e30f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            most = fmaxf(most, warp_top[w][r]);
        }
        float sum = 0.f;
        float out = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float factor = exp2f(warp_top[w][r] - most);
            sum += warp_total[w][r] * factor;
            out += warp_acc[w][r][d] * factor;
        }
        const int64_t slot = (int64_t)(row * q_heads + kv_head * REP + r) * splits + split;
        split_values[slot * D + d] = out;
        if (d == 0) {
            split_top[slot] = most;
            split_total[slot] = sum;
        }
    }
"""

_MERGE_SOURCE = """
    const int d = threadIdx.x;
    const int head = blockIdx.y;
    const int row = blockIdx.z;
    const int q_heads = gridDim.y;
    const int splits = split_top_shape[2];
    const int dim = split_values_shape[3];
    const int64_t base = ((int64_t)row * q_heads + head) * splits;
    float most = -1e30f;
    for (int s = 0; s < splits; ++s) {
        most = fmaxf(most, split_top[base + s]);
    }
    float sum = 0.f;
    float out = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float factor = exp2f(split_top[base + s] - most);
        sum += split_total[base + s] * factor;
        out += split_values[(base + s) * dim + d] * factor;
    }
    attended[((int64_t)row * q_heads + head) * dim + d] = static_cast<T>(sum > 0.f ? out / sum : 0.f);
"""


class _Kernels(threading.local):
    """The kernels, made once per thread (MLX's state is per thread)."""

    split: Any = None
    held_split: Any = None
    merge: Any = None


_kernels = _Kernels()


def _made(mx) -> _Kernels:
    if _kernels.split is None:
        outputs = ["split_values", "split_top", "split_total"]
        _kernels.split = mx.fast.cuda_kernel(
            name="masked_decode_split", input_names=["queries", "keys", "values", "mask"],
            output_names=outputs, source=_OWN_BLOCKS + _SPLIT_SOURCE, header=_HEADER,
            ensure_row_contiguous=False)
        _kernels.held_split = mx.fast.cuda_kernel(
            name="held_prefix_decode_split",
            input_names=["queries", "prefix_keys", "prefix_values", "keys", "values", "mask"],
            output_names=outputs, source=_HELD_BLOCKS + _SPLIT_SOURCE, header=_HEADER,
            ensure_row_contiguous=False)
        _kernels.merge = mx.fast.cuda_kernel(
            name="masked_decode_merge", input_names=outputs,
            output_names=["attended"], source=_MERGE_SOURCE)
    return _kernels


def elements_per_lane(dim: int, queries_per_kv_head: int) -> int:
    """How many of a key's ``dim`` elements one lane of the first kernel reads: as many
    as fit ``QUERY_ELEMENTS_PER_LANE`` over the KV head's query heads (a power of two), at most
    ``MOST_ELEMENTS_PER_LANE``, at least ``dim / 32`` (a warp a key). Fewer lanes a key
    mean wider loads and a shorter sum of each score across lanes: with Qwen3-0.6B's
    shape (head size 128, two query heads a KV head) 16 elements, eight lanes a key."""
    wanted = min(MOST_ELEMENTS_PER_LANE, QUERY_ELEMENTS_PER_LANE // queries_per_kv_head)
    return max(dim // 32, 1 << (wanted.bit_length() - 1))  # a power of two


def kernel_applies(mx, queries, keys, values, mask) -> bool:
    """Whether ``masked_decode_attention`` takes these: one query a row, half precision
    throughout, a head dimension of 64, 128 or 256 for both keys and values, at most
    ``MOST_QUERIES_PER_KV_HEAD`` query heads per KV head (of which there is a whole
    number), and a boolean mask (rows, 1, 1, keys) no longer than the buffers."""
    if queries.ndim != 4 or queries.shape[2] != 1 or mask.ndim != 4:
        return False
    rows, q_heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    return (queries.dtype in (mx.bfloat16, mx.float16)
            and keys.dtype == queries.dtype and values.dtype == queries.dtype
            and mask.dtype == mx.bool_ and dim in HEAD_DIMS
            and keys.shape[3] == dim and values.shape[3] == dim
            and keys.shape[0] == rows and values.shape[:2] == keys.shape[:2]
            and q_heads % kv_heads == 0 and q_heads // kv_heads <= MOST_QUERIES_PER_KV_HEAD
            and mask.shape[0] == rows and mask.shape[1] == 1 and mask.shape[2] == 1
            and 0 < mask.shape[3] <= min(keys.shape[2], values.shape[2]))


def masked_decode_attention(mx, queries, keys, values, mask, *, scale: float,
                            lane_elements: int | None = None):
    """The attention of ``queries`` (rows, query heads, 1, head dim) over the first
    ``mask.shape[-1]`` keys and values of the buffers ``keys`` and ``values`` (rows, KV
    heads, at least that many, head dim), each key where ``mask`` (rows, 1, 1, keys) is
    True; as MLX's ``scaled_dot_product_attention`` under that mask computes it, in
    float32 inside. A row with no key in its mask gets zeros. CUDA only; the caller
    checks ``kernel_applies`` first. ``lane_elements``: a key's elements a lane reads,
    a power of two from ``dim / 32`` to ``dim`` (default ``elements_per_lane``; for
    benchmarks comparing layouts)."""
    splits = -(-mask.shape[-1] // KEYS_PER_SPLIT)
    return _split_and_merged(mx, "split", [queries, keys, values, mask], splits, 1,
                             scale=scale, lane_elements=lane_elements)


def held_kernel_applies(mx, queries, prefix_keys, prefix_values, keys, values, mask) -> bool:
    """Whether ``held_prefix_decode_attention`` takes these: what ``kernel_applies``
    asks of the rows' own keys, and a prefix of the same KV heads, head dimension and
    dtype held once (one row)."""
    return (kernel_applies(mx, queries, keys, values, mask)
            and prefix_keys.ndim == 4 and prefix_keys.shape[0] == 1
            and prefix_keys.shape[1] == keys.shape[1] and prefix_keys.shape[3] == keys.shape[3]
            and prefix_values.shape == prefix_keys.shape and prefix_keys.shape[2] > 0
            and prefix_keys.dtype == keys.dtype and prefix_values.dtype == values.dtype)


def held_prefix_decode_attention(mx, queries, prefix_keys, prefix_values, keys, values,
                                 mask, *, scale: float, lane_elements: int | None = None):
    """The attention of ``queries`` (rows, query heads, 1, head dim) over a prefix every
    row sees, held once (``prefix_keys`` / ``prefix_values``: 1, KV heads, prefix, head
    dim), followed by each row's own keys and values as ``masked_decode_attention``
    reads them under ``mask``; as if each row held the prefix in front of its own keys.
    The same two launches: the prefix's blocks and the rows' own are one grid, merged
    alike. CUDA only; the caller checks ``held_kernel_applies`` first."""
    rows = queries.shape[0]
    splits = -(-prefix_keys.shape[2] // KEYS_PER_SPLIT) + -(-mask.shape[-1] // KEYS_PER_SPLIT)
    return _split_and_merged(
        mx, "held_split", [queries, prefix_keys, prefix_values, keys, values, mask],
        splits * rows, rows, scale=scale, lane_elements=lane_elements)


def _split_and_merged(mx, kernel: str, inputs: list, blocks: int, rows_in_blocks: int, *,
                      scale: float, lane_elements: int | None):
    """The first kernel ``kernel`` over ``blocks`` blocks of keys per KV head (and per
    row unless ``rows_in_blocks`` rows share the grid's first dimension), then the merge."""
    queries, keys = inputs[0], inputs[-3]
    rows, q_heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    splits = blocks // rows_in_blocks
    rep = q_heads // kv_heads
    lane_elements = lane_elements or elements_per_lane(dim, rep)
    if lane_elements * 32 < dim or dim % lane_elements or lane_elements & (lane_elements - 1):
        raise ValueError(f"lane_elements must be a power of two from {dim // 32} to "
                         f"{dim}, not {lane_elements}")
    kernels = _made(mx)
    scale_bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    split_values, split_top, split_total = getattr(kernels, kernel)(
        inputs=inputs,
        template=[("T", queries.dtype), ("D", dim), ("REP", rep), ("EPL", lane_elements),
                  ("SCALE_BITS", scale_bits), ("THREADS", THREADS),
                  ("KEYS_PER_LOAD", KEYS_PER_LOAD), ("KEYS_PER_SPLIT", KEYS_PER_SPLIT)],
        grid=(blocks * THREADS, kv_heads, rows // rows_in_blocks),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, q_heads, splits, dim), (rows, q_heads, splits),
                       (rows, q_heads, splits)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    (attended,) = kernels.merge(
        inputs=[split_values, split_top, split_total], template=[("T", queries.dtype)],
        grid=(dim, q_heads, rows), threadgroup=(dim, 1, 1),
        output_shapes=[(rows, q_heads, 1, dim)], output_dtypes=[queries.dtype])
    return attended
