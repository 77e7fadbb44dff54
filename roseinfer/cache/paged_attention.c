/* Decode attention over the paged pool, reading each sequence's blocks where they lie.
 *
 * One query per sequence (a decode step), every head: the query attends to the keys at
 * positions 0 .. len - 1 of its own sequence (with a sliding window only the sinks and
 * the last `window` positions), found through its block table in one layer's pool,
 * (num_blocks, n_kv_head, kv_block_size, head_dim). Nothing is copied: a block's keys for
 * one head are kv_block_size * head_dim numbers in a row, read in place, the heads of a
 * block one after the other (with grouped-query attention, query head h reads key/value
 * head h / (n_head / n_kv_head): a group's queries read the same keys where they lie,
 * never a copy per query head), and each head's part of the sequence's next block is
 * prefetched while it is read (the next block is anywhere in the pool: the processor's
 * own prefetcher cannot guess it).
 *
 * The softmax is the online one (a running maximum and sum, the weighted sum rescaled
 * when the maximum grows), block by block, so keys and values are read once each, in one
 * pass, with no buffer of scores. Every sum runs in float32, whatever the pool's dtype.
 * The sequences (split into groups of heads when there are too few to keep every thread
 * busy) are shared among OpenMP threads, as many as PyTorch uses; loaded after PyTorch,
 * the library shares PyTorch's OpenMP runtime (libgomp.so.1) and so its threads.
 *
 * Built at first use by roseinfer/cache/kernels.py with the system's C compiler, for the
 * instruction set PyTorch itself uses on this CPU (torch.backends.cpu.get_cpu_capability);
 * the compiler vectorises the loops marked `omp simd`. Head sizes of 64 (every GPT-2)
 * get a copy of the loop with the size fixed, which the compiler unrolls.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256 /* (kernels.py checks a model's head size against these) */
#define MAX_BLOCK 256

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as PyTorch */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float float_to_float(float f) { return f; }

/* e^x for x <= 0 (the softmax's exponents), in plain arithmetic the compiler vectorises
 * (libm's expf is a call per number): x = n ln2 + r, |r| <= ln2 / 2, e^x = 2^n p(r) with p
 * of degree 6 (relative error about 2e-7); below -87 (e^-87 ~ 1.6e-38), 0. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundevenf(clamped * 1.44269504088896341f);
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_to_n;
    memcpy(&two_to_n, &bits, sizeof two_to_n);
    return x <= -87.0f ? 0.0f : p * two_to_n;
}

/* One sequence's heads [h0, h1): each head's query over its visible keys. T: the pool's
 * element type, LOAD / STORE: to and from float32, D: the head size (a constant where
 * specialised). The heads are walked inside each block, not one after the other over
 * the whole sequence: a block's keys for consecutive heads lie one after the other in
 * the pool, so the reads run straight through a block's keys, then its values, long
 * runs the processor's prefetcher follows (one head's keys are only 4 KB, and a
 * sequence's next block is anywhere in the pool). */
#define ATTEND_HEADS(NAME, T, LOAD, STORE, D)                                                 \
    static inline void NAME(const T *q_seq, const T *k_pool, const T *v_pool,                  \
                            const int64_t *table, int64_t len, int64_t n_kv_head,              \
                            int64_t q_per_kv, int64_t h0, int64_t h1, int64_t head_dim,        \
                            int64_t block_size, int64_t window,                                \
                            int64_t sinks, float scale, T *out_seq) {                          \
        (void)head_dim;                                                                        \
        const int64_t heads = h1 - h0;                                                         \
        float query[heads][D], acc[heads][D], running_max[heads], running_sum[heads];          \
        float weights[MAX_BLOCK];                                                              \
        for (int64_t h = 0; h < heads; h++) {                                                  \
            for (int64_t d = 0; d < D; d++) {                                                  \
                query[h][d] = LOAD(q_seq[(h0 + h) * D + d]) * scale;                           \
                acc[h][d] = 0.0f;                                                              \
            }                                                                                  \
            running_max[h] = -INFINITY;                                                        \
            running_sum[h] = 0.0f;                                                             \
        }                                                                                      \
        /* the visible positions: the sinks [0, sink_end), then [first, len) */                \
        int64_t sink_end = 0, first = 0;                                                       \
        if (window > 0) {                                                                      \
            sink_end = sinks < len ? sinks : len;                                              \
            first = len - window > sink_end ? len - window : sink_end;                         \
        }                                                                                      \
        for (int part = 0; part < 2; part++) {                                                 \
            int64_t pos = part == 0 ? 0 : first;                                               \
            const int64_t stop = part == 0 ? sink_end : len;                                   \
            while (pos < stop) {                                                               \
                const int64_t offset = pos % block_size;                                       \
                const int64_t count = block_size - offset < stop - pos ? block_size - offset   \
                                                                       : stop - pos;           \
                const int64_t block = table[pos / block_size];                                 \
                const int64_t next = pos + count < stop ? table[(pos + count) / block_size] : -1; \
                for (int64_t h = 0; h < heads; h++) {                                          \
                    const int64_t kv_head = (h0 + h) / q_per_kv;                               \
                    const int64_t start = (block * n_kv_head + kv_head) * block_size + offset; \
                    const T *keys = k_pool + start * D;                                        \
                    const T *values = v_pool + start * D;                                      \
                    if (next >= 0) { /* this head's part of the next block, on its way in */  \
                        const int64_t at = (next * n_kv_head + kv_head) * block_size * D;      \
                        const char *next_k = (const char *)(k_pool + at);                      \
                        const char *next_v = (const char *)(v_pool + at);                      \
                        for (int64_t b = 0; b < block_size * D * (int64_t)sizeof(T); b += 64) { \
                            __builtin_prefetch(next_k + b);                              \
                            __builtin_prefetch(next_v + b);                              \
                        }                                                                      \
                    }                                                                          \
                    float block_max = -INFINITY;                                               \
                    for (int64_t j = 0; j < count; j++) {                                      \
                        float dot = 0.0f;                                                      \
                        _Pragma("omp simd reduction(+ : dot)")                                \
                        for (int64_t d = 0; d < D; d++)                                        \
                            dot += query[h][d] * LOAD(keys[j * D + d]);                        \
                        weights[j] = dot;                                                      \
                        block_max = dot > block_max ? dot : block_max;                         \
                    }                                                                          \
                    if (block_max > running_max[h]) { /* rescale what was summed so far */    \
                        const float rescale = exp_nonpositive(running_max[h] - block_max);     \
                        running_sum[h] *= rescale;                                             \
                        _Pragma("omp simd")                                                   \
                        for (int64_t d = 0; d < D; d++) acc[h][d] *= rescale;                  \
                        running_max[h] = block_max;                                            \
                    }                                                                          \
                    float block_sum = 0.0f;                                                    \
                    _Pragma("omp simd reduction(+ : block_sum)")                              \
                    for (int64_t j = 0; j < count; j++) {                                      \
                        weights[j] = exp_nonpositive(weights[j] - running_max[h]);             \
                        block_sum += weights[j];                                               \
                    }                                                                          \
                    running_sum[h] += block_sum;                                               \
                    for (int64_t j = 0; j < count; j++) {                                      \
                        const float weight = weights[j];                                       \
                        _Pragma("omp simd")                                                   \
                        for (int64_t d = 0; d < D; d++)                                        \
                            acc[h][d] += weight * LOAD(values[j * D + d]);                     \
                    }                                                                          \
                }                                                                              \
                pos += count;                                                                  \
            }                                                                                  \
        }                                                                                      \
        for (int64_t h = 0; h < heads; h++) {                                                  \
            const float inverse = 1.0f / running_sum[h];                                       \
            for (int64_t d = 0; d < D; d++)                                                    \
                out_seq[(h0 + h) * D + d] = STORE(acc[h][d] * inverse);                        \
        }                                                                                      \
    }

/* The exported function for one dtype: q (n, n_head, head_dim), the layer's pools
 * (num_blocks, n_kv_head, block_size, head_dim), tables (n, max_blocks) int64, lens (n,)
 * int64 (each query's position + 1), window <= 0 for none; out (n, n_head, head_dim);
 * threads: PyTorch's intra-op thread count (OpenMP's own is per calling thread). The
 * tasks are the sequences, each split into as many groups of heads as it takes to give
 * every thread two tasks (one sequence alone still uses every core). */
#define PAGED_DECODE_ATTENTION(NAME, T, LOAD, STORE)                                          \
    ATTEND_HEADS(NAME##_64, T, LOAD, STORE, 64)                                                \
    ATTEND_HEADS(NAME##_any, T, LOAD, STORE, head_dim)                                         \
    void NAME(const T *q, const T *k_pool, const T *v_pool, const int64_t *tables,             \
              const int64_t *lens, int64_t n, int64_t n_head, int64_t n_kv_head,               \
              int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t window,        \
              int64_t sinks,                                                                   \
              float scale, T *out, int threads) {                                              \
        const int64_t q_per_kv = n_head / n_kv_head; /* query heads per key/value head */     \
        int64_t groups = (2 * (int64_t)threads + n - 1) / n;                                   \
        groups = groups < 1 ? 1 : groups > n_head ? n_head : groups;                           \
        const int64_t per_group = (n_head + groups - 1) / groups;                              \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                 \
        for (int64_t task = 0; task < n * groups; task++) {                                    \
            const int64_t seq = task / groups, h0 = task % groups * per_group;                 \
            const int64_t h1 = h0 + per_group < n_head ? h0 + per_group : n_head;              \
            if (h0 >= h1) continue;                                                            \
            const int64_t *table = tables + seq * max_blocks;                                  \
            const T *q_seq = q + seq * n_head * head_dim;                                      \
            T *out_seq = out + seq * n_head * head_dim;                                        \
            if (head_dim == 64)                                                                \
                NAME##_64(q_seq, k_pool, v_pool, table, lens[seq], n_kv_head, q_per_kv, h0,    \
                          h1, head_dim, block_size, window, sinks, scale, out_seq);            \
            else                                                                               \
                NAME##_any(q_seq, k_pool, v_pool, table, lens[seq], n_kv_head, q_per_kv, h0,   \
                           h1, head_dim, block_size, window, sinks, scale, out_seq);           \
        }                                                                                      \
    }

PAGED_DECODE_ATTENTION(paged_decode_attention_float32, float, float_to_float, float_to_float)
PAGED_DECODE_ATTENTION(paged_decode_attention_bfloat16, uint16_t, bf16_to_float, float_to_bf16)
