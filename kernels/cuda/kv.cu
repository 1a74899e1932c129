// The paged KV cache on the device: appending a step's K/V rows, and packing/unpacking whole
// blocks to and from the mesh's transfer layout (engine/src/runner.rs, `KvSource`): per layer,
// per block in the order given, the block's K then its V, each [n_kv_heads, block_size,
// head_dim] f16. A layer's cache is [num_blocks, n_kv_heads, block_size, head_dim] f16, as on
// the CPU, so a block moves as one contiguous run.

// Writes K and V of n tokens into the cache, rounding to f16 (nearest even, as the CPU's
// write_kv). Token t's rows start at k_src + t * stride and v_src + t * stride; it goes to
// slot slots[t] = physical block * block_size + offset. One thread per (token, kv head, dim).
extern "C" __global__ void kv_append(const float* k_src, const float* v_src, long long stride,
                                     u16* k_cache, u16* v_cache, const int* slots, int n,
                                     int n_kv_heads, int head_dim, int block_size) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int row = n_kv_heads * head_dim;
    if (idx >= (long long)n * row) return;
    long long t = idx / row;
    int hd = (int)(idx % row);
    int h = hd / head_dim, d = hd % head_dim;
    long long slot = slots[t];
    long long blk = slot / block_size, off = slot % block_size;
    long long o = ((blk * n_kv_heads + h) * block_size + off) * head_dim + d;
    k_cache[o] = f32_to_f16(k_src[t * stride + hd]);
    v_cache[o] = f32_to_f16(v_src[t * stride + hd]);
}

// out = for each i < n_blocks: K of blocks[i], then its V (block_elems halves each).
// 4-byte words: block_elems is even (head_dim is).
extern "C" __global__ void kv_pack(const u32* k_cache, const u32* v_cache, const int* blocks,
                                   int n_blocks, long long block_words, u32* out) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_blocks * block_words) return;
    long long b = idx / block_words, e = idx % block_words;
    long long src = (long long)blocks[b] * block_words + e;
    out[(2 * b) * block_words + e] = k_cache[src];
    out[(2 * b + 1) * block_words + e] = v_cache[src];
}

// The inverse of kv_pack: the payload's blocks into cache blocks `blocks`.
extern "C" __global__ void kv_unpack(const u32* in, const int* blocks, int n_blocks,
                                     long long block_words, u32* k_cache, u32* v_cache) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_blocks * block_words) return;
    long long b = idx / block_words, e = idx % block_words;
    long long dst = (long long)blocks[b] * block_words + e;
    k_cache[dst] = in[(2 * b) * block_words + e];
    v_cache[dst] = in[(2 * b + 1) * block_words + e];
}
