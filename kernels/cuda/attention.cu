// Causal attention over the paged f16 KV cache, for decode (one query row per sequence) and
// prefill (many rows, attending to cached prefix blocks and the chunk's own rows) alike:
// every query row is independent, at position row_pos[r], attending to positions 0..=pos of
// its sequence through the sequence's block table. Head h reads KV head h / (n_heads /
// n_kv_heads) (GQA). q is rounded to f16 first, as on the CPU (kernels/src/cpu/attention.rs);
// the softmax is online (flash-decoding style) in f32, so results match the CPU's to rounding.

#define ATTN_MAX_WARPS 16
#define ATTN_MAX_DPL 8 // head_dim <= 256, a multiple of 32 (checked by the host)

// grid (n_rows, n_heads), block of 32 * (up to ATTN_MAX_WARPS) threads: the warps split the
// row's positions between them, so a launch of few rows (decode) takes more warps per row to
// have more of its positions read at once (kernels/src/cuda/layout.rs, attention_threads).
// q row r at q + r * q_stride (head h at h * head_dim); output row r at out + r * out_stride.
// tables + row_table[r] is the row's sequence's block table.
extern "C" __global__ void paged_attention(const float* q, long long q_stride, float* out,
                                           long long out_stride, const u16* k_cache,
                                           const u16* v_cache, const int* row_pos,
                                           const int* row_table, const int* tables, int n_heads,
                                           int n_kv_heads, int head_dim, int block_size,
                                           float scale) {
    __shared__ float s_m[ATTN_MAX_WARPS], s_l[ATTN_MAX_WARPS];
    __shared__ float s_acc[ATTN_MAX_WARPS][ATTN_MAX_DPL * 32];
    int r = blockIdx.x, h = blockIdx.y;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    int dpl = head_dim / 32;
    int kvh = h / (n_heads / n_kv_heads);
    int pos = row_pos[r];
    const int* table = tables + row_table[r];
    const float* qr = q + (long long)r * q_stride + (long long)h * head_dim;

    float qv[ATTN_MAX_DPL], acc[ATTN_MAX_DPL];
#pragma unroll
    for (int i = 0; i < ATTN_MAX_DPL; i++) {
        qv[i] = i < dpl ? f16_to_f32(f32_to_f16(qr[lane + 32 * i])) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int t = warp; t <= pos; t += warps) {
        long long blk = table[t / block_size];
        long long base = ((blk * n_kv_heads + kvh) * block_size + t % block_size) * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ATTN_MAX_DPL; i++)
            if (i < dpl) s = fmaf(qv[i], f16_to_f32(k_cache[base + lane + 32 * i]), s);
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new);
        float p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < ATTN_MAX_DPL; i++)
            if (i < dpl) acc[i] = fmaf(p, f16_to_f32(v_cache[base + lane + 32 * i]), acc[i] * corr);
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATTN_MAX_DPL; i++)
        if (i < dpl) s_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float mx = NEG_INF;
    for (int w = 0; w < warps; w++) mx = fmaxf(mx, s_m[w]);
    float total = 0.0f, wscale[ATTN_MAX_WARPS];
    for (int w = 0; w < warps; w++) {
        // A warp that saw no position has m = -inf: its weight is exp(-inf) = 0.
        wscale[w] = s_m[w] == NEG_INF ? 0.0f : expf(s_m[w] - mx);
        total += s_l[w] * wscale[w];
    }
    float inv = 1.0f / total;
    float* orow = out + (long long)r * out_stride + (long long)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < warps; w++) o += s_acc[w][d] * wscale[w];
        orow[d] = o * inv;
    }
}
