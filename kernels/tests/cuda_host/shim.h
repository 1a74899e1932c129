// Just enough CUDA to run gemv.cu's and attention.cu's kernels on the host
// (kernels/tests/cuda_host.rs): one std::thread per CUDA thread of a block, the grid's blocks
// one after another, warp shuffles through a per-warp exchange between two barriers, shared
// memory as statics (one block runs at a time). Stands in for common.cuh, with the same
// helpers as plain C++; f16 rounding as the device's cvt.rn (nearest even, through _Float16).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct alignas(16) uint4 { u32 x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct dim { unsigned x = 0, y = 0, z = 0; };

inline float2 make_float2(float x, float y) { return float2{x, y}; }

thread_local dim threadIdx, blockIdx;
inline dim blockDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

using std::max;
using std::min;

template <class T> T __ldg(const T* p) { return *p; }
inline uint4 ld_stream(const uint4* p) { return *p; }

inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }

inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

inline float f16_to_f32(u16 h) {
    _Float16 f;
    __builtin_memcpy(&f, &h, 2);
    return (float)f;
}

inline u16 f32_to_f16(float v) {
    _Float16 f = (_Float16)v;
    u16 h;
    __builtin_memcpy(&h, &f, 2);
    return h;
}

// The block's threads: a barrier for __syncthreads and one per warp for shuffles.
struct Block {
    std::barrier<> all;
    std::vector<std::unique_ptr<std::barrier<>>> warp;
    std::vector<u32> lanes;
    explicit Block(unsigned threads) : all((std::ptrdiff_t)threads), lanes(threads) {
        for (unsigned w = 0; w < threads / 32; w++) warp.push_back(std::make_unique<std::barrier<>>(32));
    }
};
inline Block* block_state;

inline void __syncthreads() { block_state->all.arrive_and_wait(); }

// Every lane of the warp offers v and takes lane src's.
inline u32 shfl_from(u32 v, unsigned src) {
    unsigned t = threadIdx.x, base = t / 32 * 32;
    auto& bar = *block_state->warp[t / 32];
    block_state->lanes[t] = v;
    bar.arrive_and_wait();
    u32 r = block_state->lanes[base + src % 32];
    bar.arrive_and_wait();
    return r;
}

inline float shfl_float(float v, unsigned src) {
    u32 b;
    __builtin_memcpy(&b, &v, 4);
    b = shfl_from(b, src);
    __builtin_memcpy(&v, &b, 4);
    return v;
}

inline int __shfl_xor_sync(unsigned, int v, int o) {
    return (int)shfl_from((u32)v, (threadIdx.x % 32) ^ (unsigned)o);
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
    return shfl_float(v, (threadIdx.x % 32) ^ (unsigned)o);
}
inline float __shfl_sync(unsigned, float v, int src) { return shfl_float(v, (unsigned)src); }
inline void __syncwarp() { block_state->warp[threadIdx.x / 32]->arrive_and_wait(); }

inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define NEG_INF (-INFINITY)

inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
