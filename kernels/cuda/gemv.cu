// Decode's GEMV on int8 activations: y[r, o] = sum_j x[r, j] * W[o, j] for up to 8 rows of x,
// W in Q4_1 or Q8_0. The arithmetic is the CPU backend's (kernels/src/cpu/matmul/quantized.rs):
// x quantized per block of 32 (quantize_q8_1, bit for bit as act.rs), then per weight block
// an exact int32 dot product (dp4a), scaled and accumulated in f32. Only the f32 sums differ:
// their order, and Q8_0 scales each half block on its own. quant.cu's gemv_q8_0 / gemv_q4_1
// are the f32 reference.
//
// W is read in the split layout made at upload (kernels/src/cuda/layout.rs): every block's
// quants as whole 128-bit words, then every block's scales. A thread block of DP4A_THREADS
// computes DP4A_ROWS weight rows; thread t takes each row's 16-byte quant words t,
// t + DP4A_THREADS, ..., so each warp load is 512 contiguous bytes of one row, and the threads
// of a block split the rows between them (many rows in flight, whatever the row length), then
// sum through shared memory. Weights are streamed past L1 (read once); the quantized x, read
// by every block, stays in L1.

#define DP4A_THREADS 128
#define DP4A_WARPS (DP4A_THREADS / 32)
// Weight rows per thread block: each activation word loaded serves R rows (the L1 traffic
// grows with the rows of x, the HBM traffic does not), and each thread has R 16-byte weight
// loads in flight.
#define DP4A_ROWS 4

__device__ __forceinline__ int warp_sum_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// x [n_blocks * 32] -> xq (int8) and ds (d, s) per block of 32, as act.rs's quantize_portable:
// d = max|x| / 127, q = round_half_even(x * (1 / d)), d and s = d * sum(q) rounded through f16.
// One warp per block.
extern "C" __global__ void quantize_q8_1(const float* x, signed char* xq, float2* ds, int n_blocks) {
    int blk = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (blk >= n_blocks) return; // the whole warp
    float v = x[(size_t)blk * 32 + lane];
    float d = warp_max(fabsf(v)) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q = max(-128, min(127, __float2int_rn(v * id)));
    xq[(size_t)blk * 32 + lane] = (signed char)q;
    int isum = warp_sum_int(q);
    if (lane == 0) {
        ds[blk] = make_float2(f16_to_f32(f32_to_f16(d)), f16_to_f32(f32_to_f16(d * (float)isum)));
    }
}

// Sums acc over the block's warps and writes y[r, row0 + j] for r < m, row0 + j < rows.
template <int MAXM, int R>
__device__ __forceinline__ void block_sum_store(float (&acc)[R][MAXM], float* y, int rows, int row0, int m) {
    __shared__ float part[DP4A_WARPS][R * MAXM];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int j = 0; j < R; j++) {
#pragma unroll
        for (int r = 0; r < MAXM; r++) {
            if (r < m) {
                float s = warp_sum(acc[j][r]);
                if (lane == 0) part[warp][j * MAXM + r] = s;
            }
        }
    }
    __syncthreads();
    int k = threadIdx.x;
    if (k < R * MAXM) {
        int j = k / MAXM, r = k % MAXM;
        if (r < m && row0 + j < rows) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < DP4A_WARPS; w++) s += part[w][k];
            y[(size_t)r * rows + row0 + j] = s;
        }
    }
}

// Q4_1: quant word b of a row is block b (byte i: element i low nibble, i + 16 high); its
// scale word is (d, m) as two f16. Per block: acc += I * (d * dx) + m * sx.
template <int MAXM, int R = DP4A_ROWS>
__device__ __forceinline__ void gemv_q4_1_dp4a(const uint4* qs, const u32* dm, const uint4* xq,
                                               const float2* xds, float* y, int rows, int nb, int m) {
    int row0 = blockIdx.x * R;
    float acc[R][MAXM];
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int r = 0; r < MAXM; r++) acc[j][r] = 0.0f;
    for (int b = threadIdx.x; b < nb; b += DP4A_THREADS) {
        uint4 w[R];
        float wd[R], wm[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            // Past the last row: read the last row again, never written.
            size_t i = (size_t)min(row0 + j, rows - 1) * nb + b;
            w[j] = ld_stream(qs + i);
            u32 s = __ldg(dm + i);
            wd[j] = f16_to_f32((u16)(s & 0xffffu));
            wm[j] = f16_to_f32((u16)(s >> 16));
        }
#pragma unroll
        for (int r = 0; r < MAXM; r++) {
            if (r < m) {
                size_t xi = (size_t)r * nb + b;
                uint4 lo = __ldg(xq + 2 * xi), hi = __ldg(xq + 2 * xi + 1);
                float2 s = __ldg(xds + xi);
#pragma unroll
                for (int j = 0; j < R; j++) {
                    const u32 M4 = 0x0f0f0f0fu;
                    int dot = __dp4a((int)(w[j].x & M4), (int)lo.x, 0);
                    dot = __dp4a((int)(w[j].y & M4), (int)lo.y, dot);
                    dot = __dp4a((int)(w[j].z & M4), (int)lo.z, dot);
                    dot = __dp4a((int)(w[j].w & M4), (int)lo.w, dot);
                    dot = __dp4a((int)((w[j].x >> 4) & M4), (int)hi.x, dot);
                    dot = __dp4a((int)((w[j].y >> 4) & M4), (int)hi.y, dot);
                    dot = __dp4a((int)((w[j].z >> 4) & M4), (int)hi.z, dot);
                    dot = __dp4a((int)((w[j].w >> 4) & M4), (int)hi.w, dot);
                    acc[j][r] = fmaf((float)dot, wd[j] * s.x, acc[j][r]);
                    acc[j][r] = fmaf(wm[j], s.y, acc[j][r]);
                }
            }
        }
    }
    block_sum_store<MAXM, R>(acc, y, rows, row0, m);
}

// Q8_0: a block's 32 quants are two words; word c of a row is half c % 2 of block c / 2, whose
// scale is d (f16). Per half block: acc += I * (d * dx).
template <int MAXM, int R = DP4A_ROWS>
__device__ __forceinline__ void gemv_q8_0_dp4a(const uint4* qs, const u16* d, const uint4* xq,
                                               const float2* xds, float* y, int rows, int nb, int m) {
    int row0 = blockIdx.x * R;
    int words = 2 * nb;
    float acc[R][MAXM];
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int r = 0; r < MAXM; r++) acc[j][r] = 0.0f;
    for (int c = threadIdx.x; c < words; c += DP4A_THREADS) {
        int b = c / 2;
        uint4 w[R];
        float wd[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            size_t row = (size_t)min(row0 + j, rows - 1);
            w[j] = ld_stream(qs + row * words + c);
            wd[j] = f16_to_f32(__ldg(d + row * nb + b));
        }
#pragma unroll
        for (int r = 0; r < MAXM; r++) {
            if (r < m) {
                uint4 xv = __ldg(xq + (size_t)r * words + c);
                float dx = __ldg(xds + (size_t)r * nb + b).x;
#pragma unroll
                for (int j = 0; j < R; j++) {
                    int dot = __dp4a((int)w[j].x, (int)xv.x, 0);
                    dot = __dp4a((int)w[j].y, (int)xv.y, dot);
                    dot = __dp4a((int)w[j].z, (int)xv.z, dot);
                    dot = __dp4a((int)w[j].w, (int)xv.w, dot);
                    acc[j][r] = fmaf((float)dot, wd[j] * dx, acc[j][r]);
                }
            }
        }
    }
    block_sum_store<MAXM, R>(acc, y, rows, row0, m);
}

// The instantiations, by the most rows of x each serves (kernels/src/cuda/layout.rs,
// DP4A_MAX_M). qs: the split copy's quants; sc: its scales; xq / xds: quantize_q8_1's output.
extern "C" __global__ void gemv_q4_1_dp4a_m1(const uint4* qs, const u32* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q4_1_dp4a<1>(qs, sc, xq, xds, y, rows, nb, m); }
extern "C" __global__ void gemv_q4_1_dp4a_m2(const uint4* qs, const u32* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q4_1_dp4a<2>(qs, sc, xq, xds, y, rows, nb, m); }
extern "C" __global__ void gemv_q4_1_dp4a_m4(const uint4* qs, const u32* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q4_1_dp4a<4>(qs, sc, xq, xds, y, rows, nb, m); }
extern "C" __global__ void gemv_q4_1_dp4a_m8(const uint4* qs, const u32* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q4_1_dp4a<8>(qs, sc, xq, xds, y, rows, nb, m); }
extern "C" __global__ void gemv_q8_0_dp4a_m1(const uint4* qs, const u16* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q8_0_dp4a<1>(qs, sc, xq, xds, y, rows, nb, m); }
extern "C" __global__ void gemv_q8_0_dp4a_m2(const uint4* qs, const u16* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q8_0_dp4a<2>(qs, sc, xq, xds, y, rows, nb, m); }
extern "C" __global__ void gemv_q8_0_dp4a_m4(const uint4* qs, const u16* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q8_0_dp4a<4>(qs, sc, xq, xds, y, rows, nb, m); }
extern "C" __global__ void gemv_q8_0_dp4a_m8(const uint4* qs, const u16* sc, const uint4* xq, const float2* xds, float* y, int rows, int nb, int m) { gemv_q8_0_dp4a<8>(qs, sc, xq, xds, y, rows, nb, m); }
