// Rotary position embedding, as the CPU backend's `rope` (kernels/src/cpu/rope.rs): the angle
// pos * base^(-2i/head_dim) in f64, its cos/sin rounded to f32, then the rotation in f32 with
// no fused multiply-add (the _rn intrinsics keep NVRTC from contracting), so results are the
// CPU's bit for bit wherever f64 sin/cos round to the same f32.

// Rotates heads [0, n_heads) of x rows: row t starts at x + t * row_stride and is at
// positions[t]. interleaved != 0 pairs (2i, 2i+1) (GGUF llama); else (i, i + head_dim/2).
// One thread per (row, head, pair).
extern "C" __global__ void rope_f32(float* x, const int* positions, int n_rows, long long row_stride,
                                    int n_heads, int head_dim, float base, int interleaved) {
    int half = head_dim / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_rows * n_heads * half) return;
    int i = (int)(idx % half);
    int h = (int)((idx / half) % n_heads);
    long long t = idx / ((long long)half * n_heads);
    double inv_freq = pow((double)base, -2.0 * (double)i / (double)head_dim);
    double s, c;
    sincos((double)positions[t] * inv_freq, &s, &c);
    float cf = (float)c, sf = (float)s;
    float* hp = x + t * row_stride + (long long)h * head_dim;
    int a = interleaved ? 2 * i : i;
    int b = interleaved ? 2 * i + 1 : i + half;
    float x0 = hp[a], x1 = hp[b];
    hp[a] = __fsub_rn(__fmul_rn(x0, cf), __fmul_rn(x1, sf));
    hp[b] = __fadd_rn(__fmul_rn(x0, sf), __fmul_rn(x1, cf));
}
