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

// The same attention for prefill: one block computes a tile of up to TILE_ROWS query rows of
// one sequence (rows tiles[t]..tiles[t + 1], one block table) for head h, walking the
// positions TILE_POS at a time. Each chunk of K and V is read once into shared memory for
// the whole tile, where paged_attention reads the whole prefix again for every row. Warp w
// owns rows w * ROWS_PER_WARP.. of the tile; lane j scores position j of the chunk, and the
// lanes then own the head dimensions of the output (as in paged_attention).
#define TILE_ROWS 32
#define TILE_POS 32
#define TILE_WARPS 4
#define ROWS_PER_WARP (TILE_ROWS / TILE_WARPS)
#define TILE_MAX_DPL 4 // head_dim <= 128 (checked by the host)
#define TILE_MAX_HD (TILE_MAX_DPL * 32)
// K rows padded by one 32-bit word, so the lanes reading K rows j = 0..31 hit distinct banks.
#define TILE_K_STRIDE (TILE_MAX_HD + 2)

extern "C" __global__ void paged_attention_tiled(const float* q, long long q_stride, float* out,
                                                 long long out_stride, const u16* k_cache,
                                                 const u16* v_cache, const int* row_pos,
                                                 const int* row_table, const int* tables,
                                                 const int* tiles, int n_heads, int n_kv_heads,
                                                 int head_dim, int block_size, float scale) {
    // float4 reads of queries and weights, u32 reads of K: 16-byte aligned.
    __shared__ __align__(16) float s_q[TILE_ROWS][TILE_MAX_HD];
    __shared__ __align__(16) u16 s_k[TILE_POS][TILE_K_STRIDE];
    __shared__ __align__(16) u16 s_v[TILE_POS][TILE_MAX_HD];
    // Each warp's rows' weights of the chunk's positions, read back four at a time.
    __shared__ __align__(16) float s_p[TILE_WARPS][ROWS_PER_WARP][TILE_POS];
    __shared__ int s_last;
    int h = blockIdx.y;
    int first = tiles[blockIdx.x], n_tile = tiles[blockIdx.x + 1] - first;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int dpl = head_dim / 32;
    int kvh = h / (n_heads / n_kv_heads);
    const int* table = tables + row_table[first];

    // The tile's queries, rounded to f16 as on the CPU; rows past the tile are zero.
    for (int i = threadIdx.x; i < TILE_ROWS * head_dim; i += blockDim.x) {
        int r = i / head_dim, d = i % head_dim;
        float v = 0.0f;
        if (r < n_tile) v = q[(long long)(first + r) * q_stride + (long long)h * head_dim + d];
        s_q[r][d] = f16_to_f32(f32_to_f16(v));
    }
    if (threadIdx.x == 0) {
        int last = 0;
        for (int r = 0; r < n_tile; r++) last = max(last, row_pos[first + r]);
        s_last = last;
    }

    int pos[ROWS_PER_WARP];
    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][TILE_MAX_DPL];
#pragma unroll
    for (int k = 0; k < ROWS_PER_WARP; k++) {
        int r = warp * ROWS_PER_WARP + k;
        // A row past the tile attends to nothing (position -1) and writes nothing.
        pos[k] = r < n_tile ? row_pos[first + r] : -1;
        m[k] = NEG_INF;
        l[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < TILE_MAX_DPL; i++) acc[k][i] = 0.0f;
    }
    __syncthreads();
    int last = s_last;

    for (int c0 = 0; c0 <= last; c0 += TILE_POS) {
        // This chunk's K and V; positions past the tile's last row are never read (the block
        // table may end before them) and are masked below.
        for (int i = threadIdx.x; i < TILE_POS * head_dim; i += blockDim.x) {
            int j = i / head_dim, d = i % head_dim, t = c0 + j;
            u16 kv = 0, vv = 0;
            if (t <= last) {
                long long blk = table[t / block_size];
                long long at =
                    ((blk * n_kv_heads + kvh) * block_size + t % block_size) * head_dim + d;
                kv = k_cache[at];
                vv = v_cache[at];
            }
            s_k[j][d] = kv;
            s_v[j][d] = vv;
        }
        __syncthreads();

        // Lane j's scores of position c0 + j against the warp's rows, four dimensions at a
        // time (head_dim is a multiple of 32).
        float s[ROWS_PER_WARP];
#pragma unroll
        for (int k = 0; k < ROWS_PER_WARP; k++) s[k] = 0.0f;
        for (int d = 0; d < head_dim; d += 4) {
            const u32* kw = (const u32*)&s_k[lane][d];
            u32 k01 = kw[0], k23 = kw[1];
            float k0 = f16_to_f32((u16)(k01 & 0xffffu)), k1 = f16_to_f32((u16)(k01 >> 16));
            float k2 = f16_to_f32((u16)(k23 & 0xffffu)), k3 = f16_to_f32((u16)(k23 >> 16));
#pragma unroll
            for (int k = 0; k < ROWS_PER_WARP; k++) {
                float4 qv = *(const float4*)&s_q[warp * ROWS_PER_WARP + k][d];
                s[k] = fmaf(qv.x, k0, s[k]);
                s[k] = fmaf(qv.y, k1, s[k]);
                s[k] = fmaf(qv.z, k2, s[k]);
                s[k] = fmaf(qv.w, k3, s[k]);
            }
        }
        int t = c0 + lane;
#pragma unroll
        for (int k = 0; k < ROWS_PER_WARP; k++) {
            s[k] = t <= pos[k] ? s[k] * scale : NEG_INF;
            float m_new = fmaxf(m[k], warp_max(s[k]));
            // Nothing seen yet (a row past the tile): keep it empty.
            if (m_new == NEG_INF) {
                s[k] = 0.0f;
                continue;
            }
            float corr = m[k] == NEG_INF ? 0.0f : expf(m[k] - m_new);
            float p = s[k] == NEG_INF ? 0.0f : expf(s[k] - m_new);
            l[k] = l[k] * corr + warp_sum(p);
            m[k] = m_new;
            s[k] = p;
#pragma unroll
            for (int i = 0; i < TILE_MAX_DPL; i++) acc[k][i] *= corr;
        }
#pragma unroll
        for (int k = 0; k < ROWS_PER_WARP; k++) s_p[warp][k][lane] = s[k];
        __syncwarp();
        // Weighted V: lane owns dimensions lane + 32 * i; positions' weights four at a time.
        for (int j = 0; j < TILE_POS; j += 4) {
            float v[4][TILE_MAX_DPL];
#pragma unroll
            for (int jj = 0; jj < 4; jj++)
#pragma unroll
                for (int i = 0; i < TILE_MAX_DPL; i++)
                    v[jj][i] = i < dpl ? f16_to_f32(s_v[j + jj][lane + 32 * i]) : 0.0f;
#pragma unroll
            for (int k = 0; k < ROWS_PER_WARP; k++) {
                float4 p = *(const float4*)&s_p[warp][k][j];
#pragma unroll
                for (int i = 0; i < TILE_MAX_DPL; i++) {
                    acc[k][i] = fmaf(p.x, v[0][i], acc[k][i]);
                    acc[k][i] = fmaf(p.y, v[1][i], acc[k][i]);
                    acc[k][i] = fmaf(p.z, v[2][i], acc[k][i]);
                    acc[k][i] = fmaf(p.w, v[3][i], acc[k][i]);
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int k = 0; k < ROWS_PER_WARP; k++) {
        int r = warp * ROWS_PER_WARP + k;
        if (r >= n_tile) continue;
        float inv = 1.0f / l[k];
        float* orow = out + (long long)(first + r) * out_stride + (long long)h * head_dim;
#pragma unroll
        for (int i = 0; i < TILE_MAX_DPL; i++)
            if (i < dpl) orow[lane + 32 * i] = acc[k][i] * inv;
    }
}
