// Quantized weights on the device, read as stored (ggml block layouts, byte for byte as in the
// GGUF file; see kernels/src/quant.rs): the fused dequantizing GEMV of decode, and the one-off
// dequantization to f16/bf16 that prefill's cuBLAS GEMMs read.

// Most activation rows one GEMV launch serves: each weight byte is read once for all of them.
#define GEMV_MAX_M 8
// Warps (output rows) per block.
#define GEMV_WARPS 4

// y[r, o] = sum_j x[r, j] * W[o, j] for r < m <= GEMV_MAX_M, W = [rows, cols] in Q8_0.
// One warp per output row; lane l takes blocks l, l + 32, ... of the row.
extern "C" __global__ void gemv_q8_0(const u8* w, const float* x, float* y, int rows, int cols, int m) {
    int row = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int nb = cols / 32;
    const u8* wr = w + (size_t)row * nb * 34;
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) acc[r] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        const u8* blk = wr + (size_t)b * 34;
        float d = f16_at(blk);
        float q[32];
#pragma unroll
        for (int j = 0; j < 32; j++) q[j] = (float)(signed char)blk[2 + j];
#pragma unroll
        for (int r = 0; r < GEMV_MAX_M; r++) {
            if (r < m) {
                const float* xb = x + (size_t)r * cols + b * 32;
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 32; j++) s = fmaf(q[j], xb[j], s);
                acc[r] = fmaf(d, s, acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) {
        if (r < m) {
            float s = warp_sum(acc[r]);
            if (lane == 0) y[(size_t)r * rows + row] = s;
        }
    }
}

// As gemv_q8_0 for Q4_1: y = d * sum(q * x) + m * sum(x) per block.
extern "C" __global__ void gemv_q4_1(const u8* w, const float* x, float* y, int rows, int cols, int m) {
    int row = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int nb = cols / 32;
    const u8* wr = w + (size_t)row * nb * 20;
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) acc[r] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        const u8* blk = wr + (size_t)b * 20;
        float d = f16_at(blk), mn = f16_at(blk + 2);
        float q[32];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u8 v = blk[4 + j];
            q[j] = (float)(v & 15);
            q[j + 16] = (float)(v >> 4);
        }
#pragma unroll
        for (int r = 0; r < GEMV_MAX_M; r++) {
            if (r < m) {
                const float* xb = x + (size_t)r * cols + b * 32;
                float s = 0.0f, sx = 0.0f;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    s = fmaf(q[j], xb[j], s);
                    sx += xb[j];
                }
                acc[r] = fmaf(d, s, fmaf(mn, sx, acc[r]));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) {
        if (r < m) {
            float s = warp_sum(acc[r]);
            if (lane == 0) y[(size_t)r * rows + row] = s;
        }
    }
}

// out = W dequantized to bf16 ([rows, cols] row-major), for cuBLAS; run once at load.
extern "C" __global__ void dequant_bf16(const u8* w, u16* out, int rows, int cols, long long row_bytes, int fmt) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    long long r = i / cols;
    out[i] = f32_to_bf16(dequant_elem(fmt, w + r * row_bytes, (int)(i % cols)));
}

// As dequant_bf16, to f16.
extern "C" __global__ void dequant_f16(const u8* w, u16* out, int rows, int cols, long long row_bytes, int fmt) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    long long r = i / cols;
    out[i] = f32_to_f16(dequant_elem(fmt, w + r * row_bytes, (int)(i % cols)));
}
