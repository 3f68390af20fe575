"""The CUDA source of our masked decode kernels (``runtime.cuda_masked_decode`` builds them).

Owns the source text only: ``HEADER`` (the loads and ``attend_split``, one block's work
over a span of keys for one or several rows' queries), ``OWN_SOURCE`` (the first kernel
over each row's own keys under its mask), ``HELD_SOURCE`` (the same after a prefix held
once for all rows) and ``MERGE_SOURCE`` (the second kernel, which merges a row's
splits). The template values (``T``, ``D``, ``REP``, ``EPL``, ``ROWS``, ``HELD_EPL``,
``SCALE_BITS``, ``THREADS``, ``KEYS_PER_LOAD``, ``KEYS_PER_SPLIT``) come from
``runtime.cuda_masked_decode``, which says what each is.
"""

# Pack: a lane's EPL elements of one head's vector, loaded at once where they lie
# contiguous and aligned; else one by one along their stride. KeySpan: the keys one block
# of the first kernel reads. attend_split: that block's work.
HEADER = """
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

// Keys [first, last) of one KV head: where its keys and values lie (element 0 of key 0)
// and their strides; under a mask (a row's own keys) the mask's row, else none.
template <typename T>
struct KeySpan {
    const T* keys;
    const T* values;
    int64_t key_step, key_element, value_step, value_element;
    bool keys_packed, values_packed;
    bool masked;
    const bool* live;
    int64_t live_step;
    int first, last;
};

// Keys [first, last) of row ``row`` and KV head ``kv_head`` of a layer's buffers,
// unmasked (the caller sets the mask of a row's own keys).
template <typename T, int EPL>
__device__ inline KeySpan<T> key_span(
        const T* keys, const mlx::core::cu::Strides& keys_strides, const T* values,
        const mlx::core::cu::Strides& values_strides, int row, int kv_head, int first,
        int last) {
    KeySpan<T> span;
    span.keys = keys + row * keys_strides[0] + kv_head * keys_strides[1];
    span.values = values + row * values_strides[0] + kv_head * values_strides[1];
    span.key_step = keys_strides[2];
    span.key_element = keys_strides[3];
    span.value_step = values_strides[2];
    span.value_element = values_strides[3];
    span.keys_packed = packs<T, EPL>(keys, keys_strides);
    span.values_packed = packs<T, EPL>(values, values_strides);
    span.masked = false;
    span.live = nullptr;
    span.live_step = 0;
    span.first = first;
    span.last = last;
    return span;
}

// One block of the first kernel: the running maximum, sum and weighted values over the
// keys of ``span`` for the REP query heads of its KV head of each of ``n_rows`` rows
// from ``first_row`` (at most ROWS; every one of them sees those keys), written to
// their slots of split ``split``. Each key is read once for all ROWS * REP queries.
// ``shared``: (2 + D) * warps * ROWS * REP floats.
template <typename T, int D, int REP, int ROWS, int EPL, int THREADS, int KEYS_PER_LOAD>
__device__ inline void attend_split(
        const T* queries, const mlx::core::cu::Strides& queries_strides, float scale_log2,
        int first_row, int n_rows, int kv_head, int q_heads, const KeySpan<T>& span,
        float* shared, float* split_values, float* split_top, float* split_total,
        int split, int splits) {
    constexpr int QN = ROWS * REP;
    constexpr int LANES_PER_KEY = D / EPL;
    constexpr int WARPS = THREADS / 32;
    constexpr int GROUPS = THREADS / LANES_PER_KEY;
    using P = Pack<T, EPL>;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int part = lane % LANES_PER_KEY;
    const int group = threadIdx.x / LANES_PER_KEY;
    const bool queries_packed = packs<T, EPL>(queries, queries_strides);

    // Query n is query head n % REP of the KV head, of row first_row + n / REP; a row
    // past n_rows (a last group short of ROWS) reads zeros and is never written.
    float q[QN][EPL];
    float top[QN], total[QN], acc[QN][EPL];
    #pragma unroll
    for (int n = 0; n < QN; ++n) {
        P p = {};
        if (n / REP < n_rows) {
            p = load_pack<T, EPL>(
                queries + (first_row + n / REP) * queries_strides[0]
                + (kv_head * REP + n % REP) * queries_strides[1]
                + part * EPL * queries_strides[3], queries_strides[3], queries_packed);
        }
        #pragma unroll
        for (int i = 0; i < EPL; ++i) {
            q[n][i] = scale_log2 * static_cast<float>(p.x[i]);
            acc[n][i] = 0.f;
        }
        top[n] = -1e30f;
        total[n] = 0.f;
    }
    const T* key_at = span.keys + part * EPL * span.key_element;
    const T* value_at = span.values + part * EPL * span.value_element;

    // A block whose keys are all masked (a row's left padding) reads none of them.
    bool any_live = !span.masked;
    for (int i = span.first + threadIdx.x; span.masked && i < span.last; i += THREADS) {
        any_live = any_live || span.live[i * span.live_step];
    }
    const int end = __syncthreads_or(any_live) ? span.last : span.first;
    // A group of LANES_PER_KEY lanes reads one key (each lane EPL elements of it), the
    // block's groups KEYS_PER_LOAD keys each at once: the mask, key and value loads of
    // a pass are all in flight together (none waits for another's answer). The passes
    // are the same for every lane, as the shuffles below need.
    for (int base = span.first; base < end; base += GROUPS * KEYS_PER_LOAD) {
        P kp[KEYS_PER_LOAD] = {};
        P vp[KEYS_PER_LOAD] = {};
        bool live[KEYS_PER_LOAD];
        #pragma unroll
        for (int u = 0; u < KEYS_PER_LOAD; ++u) {
            const int i = base + group + u * GROUPS;
            live[u] = false;
            if (i < end) {
                live[u] = !span.masked || span.live[i * span.live_step];
                kp[u] = load_pack<T, EPL>(key_at + i * span.key_step, span.key_element,
                                          span.keys_packed);
                vp[u] = load_pack<T, EPL>(value_at + i * span.value_step,
                                          span.value_element, span.values_packed);
            }
        }
        float score[KEYS_PER_LOAD][QN];
        #pragma unroll
        for (int u = 0; u < KEYS_PER_LOAD; ++u) {
            #pragma unroll
            for (int n = 0; n < QN; ++n) {
                float dot = 0.f;
                #pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    dot += q[n][i] * static_cast<float>(kp[u].x[i]);
                }
                #pragma unroll
                for (int offset = LANES_PER_KEY / 2; offset > 0; offset >>= 1) {
                    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
                }
                score[u][n] = live[u] ? dot : -1e30f;
            }
        }
        #pragma unroll
        for (int n = 0; n < QN; ++n) {
            float most = top[n];
            #pragma unroll
            for (int u = 0; u < KEYS_PER_LOAD; ++u) {
                most = fmaxf(most, score[u][n]);
            }
            const float keep = exp2f(top[n] - most);
            total[n] *= keep;
            #pragma unroll
            for (int i = 0; i < EPL; ++i) {
                acc[n][i] *= keep;
            }
            top[n] = most;
            #pragma unroll
            for (int u = 0; u < KEYS_PER_LOAD; ++u) {
                if (live[u]) {  // a masked key's values are never summed, whatever they hold
                    const float weight = exp2f(score[u][n] - most);
                    total[n] += weight;
                    #pragma unroll
                    for (int i = 0; i < EPL; ++i) {
                        acc[n][i] += weight * static_cast<float>(vp[u].x[i]);
                    }
                }
            }
        }
    }

    // A warp's groups merged into each of its groups (lanes LANES_PER_KEY apart).
    #pragma unroll
    for (int offset = LANES_PER_KEY; offset < 32; offset <<= 1) {
        #pragma unroll
        for (int n = 0; n < QN; ++n) {
            const float other_top = __shfl_xor_sync(0xffffffffu, top[n], offset);
            const float other_total = __shfl_xor_sync(0xffffffffu, total[n], offset);
            const float most = fmaxf(top[n], other_top);
            const float mine = exp2f(top[n] - most);
            const float theirs = exp2f(other_top - most);
            total[n] = total[n] * mine + other_total * theirs;
            #pragma unroll
            for (int i = 0; i < EPL; ++i) {
                const float other = __shfl_xor_sync(0xffffffffu, acc[n][i], offset);
                acc[n][i] = acc[n][i] * mine + other * theirs;
            }
            top[n] = most;
        }
    }

    // The warps merged through shared memory: [warp][n] maxima, then sums, then values.
    float* warp_top = shared;
    float* warp_total = shared + WARPS * QN;
    float* warp_acc = shared + 2 * WARPS * QN;
    if (lane < LANES_PER_KEY) {
        #pragma unroll
        for (int n = 0; n < QN; ++n) {
            if (lane == 0) {
                warp_top[warp * QN + n] = top[n];
                warp_total[warp * QN + n] = total[n];
            }
            #pragma unroll
            for (int i = 0; i < EPL; ++i) {
                warp_acc[(warp * QN + n) * D + part * EPL + i] = acc[n][i];
            }
        }
    }
    __syncthreads();
    for (int at = threadIdx.x; at < QN * D; at += THREADS) {
        const int n = at / D;
        const int d = at % D;
        if (n / REP >= n_rows) {
            continue;
        }
        float most = -1e30f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            most = fmaxf(most, warp_top[w * QN + n]);
        }
        float sum = 0.f;
        float out = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float factor = exp2f(warp_top[w * QN + n] - most);
            sum += warp_total[w * QN + n] * factor;
            out += warp_acc[(w * QN + n) * D + d] * factor;
        }
        const int64_t slot = ((int64_t)(first_row + n / REP) * q_heads + kv_head * REP
                              + n % REP) * splits + split;
        split_values[slot * D + d] = out;
        if (d == 0) {
            split_top[slot] = most;
            split_total[slot] = sum;
        }
    }
}
"""

# A row's own keys, under its mask: the setup both first kernels share.
OWN_SPAN = """
    KeySpan<T> own = key_span<T, EPL>(
        keys, keys_strides, values, values_strides, row, kv_head,
        own_split * KEYS_PER_SPLIT, min((own_split + 1) * KEYS_PER_SPLIT, (int)mask_shape[3]));
    own.masked = true;
    own.live = mask + row * mask_strides[0];
    own.live_step = mask_strides[3];
"""

# The first kernel over each row's keys: a block per split of a row's keys, KV head and
# row.
OWN_SOURCE = """
    __shared__ float shared[(2 + D) * (THREADS / 32) * REP];
    const float scale_log2 = __int_as_float(SCALE_BITS) * 1.44269504089f;
    const int own_split = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int row = blockIdx.z;
""" + OWN_SPAN + """
    attend_split<T, D, REP, 1, EPL, THREADS, KEYS_PER_LOAD>(
        queries, queries_strides, scale_log2, row, 1, kv_head, keys_shape[1] * REP, own,
        shared, split_values, split_top, split_total, own_split, gridDim.x);
"""

# The first kernel over a prefix held once for all rows (runtime.held_prefix), then each
# row's own keys. The prefix's splits come first, each read by a block per group of ROWS
# rows (the groups of one split side by side, so that a split's keys come from memory
# once and from the L2 cache for the other groups); then a block per split of each
# row's own keys, as in the kernel above, with the split counted after the prefix's.
HELD_SOURCE = """
    __shared__ float shared[(2 + D) * (THREADS / 32) * REP * ROWS];
    const float scale_log2 = __int_as_float(SCALE_BITS) * 1.44269504089f;
    const int rows = queries_shape[0];
    const int groups = (rows + ROWS - 1) / ROWS;
    const int kv_head = blockIdx.y;
    const int q_heads = keys_shape[1] * REP;
    const int prefix_splits = (prefix_keys_shape[2] + KEYS_PER_SPLIT - 1) / KEYS_PER_SPLIT;
    const int splits = prefix_splits + (mask_shape[3] + KEYS_PER_SPLIT - 1) / KEYS_PER_SPLIT;
    if (blockIdx.x < prefix_splits * groups) {
        const int group = blockIdx.x % groups;
        const int split = blockIdx.x / groups;
        const KeySpan<T> prefix = key_span<T, HELD_EPL>(
            prefix_keys, prefix_keys_strides, prefix_values, prefix_values_strides, 0,
            kv_head, split * KEYS_PER_SPLIT,
            min((split + 1) * KEYS_PER_SPLIT, (int)prefix_keys_shape[2]));
        attend_split<T, D, REP, ROWS, HELD_EPL, THREADS, KEYS_PER_LOAD>(
            queries, queries_strides, scale_log2, group * ROWS, min(ROWS, rows - group * ROWS),
            kv_head, q_heads, prefix, shared, split_values, split_top, split_total, split,
            splits);
    } else {
        const int b = blockIdx.x - prefix_splits * groups;
        const int row = b % rows;
        const int own_split = b / rows;
""" + OWN_SPAN + """
        attend_split<T, D, REP, 1, EPL, THREADS, KEYS_PER_LOAD>(
            queries, queries_strides, scale_log2, row, 1, kv_head, q_heads, own, shared,
            split_values, split_top, split_total, prefix_splits + own_split, splits);
    }
"""

MERGE_SOURCE = """
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
