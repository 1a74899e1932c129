// Row-wise and elementwise ops of the forward pass: RMSNorm, residual add, bias add, SiLU·mul,
// embedding gather, f32 -> bf16 activations for cuBLAS.

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, one block per row. Squares summed in f64 as
// the CPU backend does (the order differs, so results agree to rounding, not bit for bit).
extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, float* out, int d, float eps) {
    __shared__ double part[32];
    const float* xr = x + (size_t)blockIdx.x * d;
    float* orow = out + (size_t)blockIdx.x * d;
    double s = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += (double)(xr[i] * xr[i]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)(blockDim.x / 32) ? part[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) part[0] = s;
    }
    __syncthreads();
    float mean = (float)(part[0] / d);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = (xr[i] * scale) * w[i];
}

// x += y elementwise.
extern "C" __global__ void add_f32(float* x, const float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x[r, :] += b for every row of x = [rows, cols].
extern "C" __global__ void add_rows_f32(float* x, const float* b, long long n, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]; gate_up = [n, 2*inter].
extern "C" __global__ void silu_mul_f32(const float* gate_up, float* out, long long n, int inter) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long t = i / inter, c = i % inter;
    float a = gate_up[t * 2 * inter + c];
    float b = gate_up[t * 2 * inter + inter + c];
    out[i] = a / (1.0f + expf(-a)) * b;
}

// out[t, :] = row tokens[t] of an embedding table in ggml layout (`fmt`, `row_bytes` a row).
// One block per token.
extern "C" __global__ void embed_rows(const u8* table, const int* tokens, float* out, int cols,
                                      long long row_bytes, int fmt) {
    const u8* row = table + (size_t)tokens[blockIdx.x] * row_bytes;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = dequant_elem(fmt, row, j);
}

// bf16 (round to nearest even) copy of f32 activations, the A operand of a cuBLAS GEMM.
extern "C" __global__ void f32_to_bf16(const float* x, u16* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(x[i]);
}
