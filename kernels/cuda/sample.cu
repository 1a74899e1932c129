// Token selection on the device, one block of SAMPLE_THREADS per row of logits [rows, vocab]:
// greedy argmax (the first maximum, as the CPU sampler's `argmax`), and temperature / top-k /
// top-p draws. Truncation is by thresholds found by bisection over the logits' order-preserving
// integer keys (exact, 32 passes each), so no sort is needed; tokens tied at a threshold are all
// kept (the CPU keeps the lower ids). The draw walks the kept tokens in id order.

#define SAMPLE_THREADS 1024

// An unsigned key that orders as the float does (NaN placed lowest, as the CPU sampler).
__device__ __forceinline__ u32 order_key(float f) {
    if (f != f) return 0;
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? sh[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

__device__ float block_max(float v, float* sh) {
    v = warp_max(v);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? sh[lane] : NEG_INF;
        v = warp_max(v);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

__device__ int block_min_int(int v, int* sh) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? sh[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

// The first index of the largest non-NaN logit (0 when none beats -inf).
__device__ int row_argmax(const float* l, int vocab, float* shf, int* shi) {
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (l[i] > mx) mx = l[i];
    mx = block_max(mx, shf);
    if (mx == NEG_INF) return 0;
    int first = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (l[i] == mx) { first = i; break; }
    return block_min_int(first, shi);
}

extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    __shared__ float shf[32];
    __shared__ int shi[32];
    int r = row_argmax(logits + (long long)blockIdx.x * vocab, vocab, shf, shi);
    if (threadIdx.x == 0) out[blockIdx.x] = r;
}

// Per row: temperature[r] == 0 or top_k[r] == 1 is greedy; else logits / temperature, the
// top_k[r] highest (0: all), then the smallest prefix of those by descending probability
// holding top_p[r] of their mass, then a draw with uniform[r] in [0, 1).
extern "C" __global__ void sample_rows(const float* logits, int vocab, const float* temperature,
                                       const int* top_k, const float* top_p,
                                       const float* uniform, int* out) {
    __shared__ float shf[32];
    __shared__ int shi[32];
    __shared__ float prefix[SAMPLE_THREADS];
    const float* l = logits + (long long)blockIdx.x * vocab;
    float temp = temperature[blockIdx.x];
    int k = top_k[blockIdx.x];
    if (temp <= 0.0f || k == 1) {
        int r = row_argmax(l, vocab, shf, shi);
        if (threadIdx.x == 0) out[blockIdx.x] = r;
        return;
    }
    float inv_t = 1.0f / temp;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (l[i] > mx) mx = l[i];
    mx = block_max(mx, shf);
    if (mx == NEG_INF) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0;
        return;
    }

    // Top-k: the largest key K with count(key >= K) >= k.
    u32 kmin = 0;
    if (k > 0 && k < vocab) {
        u32 lo = 0, hi = 0xffffffffu; // count(>= lo) >= k holds; find the largest such lo
        while (lo < hi) {
            u32 mid = lo + (hi - lo) / 2 + 1;
            float c = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) c += order_key(l[i]) >= mid ? 1.0f : 0.0f;
            c = block_sum(c, shf);
            if (c >= (float)k) lo = mid; else hi = mid - 1;
        }
        kmin = lo;
    }
    // Weights of the top-k set.
    float total = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (order_key(l[i]) >= kmin && l[i] == l[i]) total += expf((l[i] - mx) * inv_t);
    total = block_sum(total, shf);

    // Top-p: the largest key P >= kmin with mass(key >= P) >= top_p * total.
    u32 pmin = kmin;
    float p = top_p[blockIdx.x];
    if (p < 1.0f) {
        float need = p * total;
        u32 lo = kmin, hi = 0xffffffffu;
        while (lo < hi) {
            u32 mid = lo + (hi - lo) / 2 + 1;
            float s = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                if (order_key(l[i]) >= mid) s += expf((l[i] - mx) * inv_t);
            s = block_sum(s, shf);
            if (s >= need) lo = mid; else hi = mid - 1;
        }
        pmin = lo;
    }

    // The draw: each thread sums its contiguous run of ids, a prefix over threads, then the
    // thread whose run holds the target walks it.
    int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    int begin = min(vocab, (int)threadIdx.x * chunk), end = min(vocab, begin + chunk);
    float mine = 0.0f;
    int last_kept = -1;
    for (int i = begin; i < end; i++)
        if (order_key(l[i]) >= pmin && l[i] == l[i]) {
            mine += expf((l[i] - mx) * inv_t);
            last_kept = i;
        }
    prefix[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        float run = 0.0f;
        for (int t = 0; t < (int)blockDim.x; t++) {
            float v = prefix[t];
            prefix[t] = run;
            run += v;
        }
        shf[0] = run;
        shi[0] = -1;
    }
    __syncthreads();
    float kept = shf[0];
    float target = uniform[blockIdx.x] * kept;
    float at = prefix[threadIdx.x];
    if (mine > 0.0f && target >= at && target < at + mine) {
        for (int i = begin; i < end; i++)
            if (order_key(l[i]) >= pmin && l[i] == l[i]) {
                at += expf((l[i] - mx) * inv_t);
                if (target < at) { shi[0] = i; break; }
            }
        if (shi[0] < 0) shi[0] = last_kept; // rounding left a sliver: the run's last kept id
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int r = shi[0];
        if (r < 0) { // rounding put the target past every run: the last kept id overall
            for (int i = vocab - 1; i >= 0; i--)
                if (order_key(l[i]) >= pmin && l[i] == l[i]) { r = i; break; }
        }
        out[blockIdx.x] = r < 0 ? 0 : r;
    }
}
