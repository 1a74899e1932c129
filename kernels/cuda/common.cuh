// Shared device helpers, pasted ahead of every kernel source by the Rust loader (NVRTC sees
// one translation unit per source; no CUDA headers are needed, so any NVRTC compiles these).
//
// Halves travel as raw 16-bit patterns (`unsigned short`): f16 and bf16 conversions are single
// PTX instructions, round-to-nearest-even like the CPU backend's `half` crate.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even, NaN kept quiet (as `half::bf16::from_f32`).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// Little-endian f16 at an arbitrary byte address (ggml blocks are not 2-byte aligned in rows
// of 34-byte Q8_0 blocks).
__device__ __forceinline__ float f16_at(const u8* p) {
    return f16_to_f32((u16)p[0] | ((u16)p[1] << 8));
}

// 16 bytes read once (weights streamed through a GEMV): past L1, so what is reused stays there.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Weight formats, numbered as `kvmesh_kernels::cuda::format_code`.
#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q8_0 3
#define FMT_Q4_0 4
#define FMT_Q4_1 5

__device__ __forceinline__ int fmt_block_elems(int fmt) { return fmt >= FMT_Q8_0 ? 32 : 1; }

__device__ __forceinline__ int fmt_block_bytes(int fmt) {
    switch (fmt) {
    case FMT_F32: return 4;
    case FMT_F16: case FMT_BF16: return 2;
    case FMT_Q8_0: return 34;
    case FMT_Q4_0: return 18;
    default: return 20; // Q4_1
    }
}

// Element `j` of a row stored in ggml layout, as ggml's dequantize_row_* computes it.
__device__ __forceinline__ float dequant_elem(int fmt, const u8* row, int j) {
    switch (fmt) {
    case FMT_F32: return __uint_as_float(*(const u32*)(row + 4 * (size_t)j));
    case FMT_F16: return f16_at(row + 2 * (size_t)j);
    case FMT_BF16: return bf16_to_f32((u16)row[2 * j] | ((u16)row[2 * j + 1] << 8));
    case FMT_Q8_0: {
        const u8* b = row + (size_t)(j / 32) * 34;
        return (float)(signed char)b[2 + j % 32] * f16_at(b);
    }
    case FMT_Q4_0: {
        const u8* b = row + (size_t)(j / 32) * 18;
        int i = j % 32;
        int q = i < 16 ? (b[2 + i] & 15) : (b[2 + i - 16] >> 4);
        return (float)(q - 8) * f16_at(b);
    }
    default: { // Q4_1
        const u8* b = row + (size_t)(j / 32) * 20;
        int i = j % 32;
        int q = i < 16 ? (b[4 + i] & 15) : (b[4 + i - 16] >> 4);
        return (float)q * f16_at(b) + f16_at(b + 2);
    }
    }
}

#define NEG_INF __int_as_float(0xff800000)
