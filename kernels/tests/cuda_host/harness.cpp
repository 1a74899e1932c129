// Runs kernels of gemv.cu and attention.cu on the host through shim.h, launched as
// CudaDevice launches them, on the inputs kernels/tests/cuda_host.rs writes into DIR:
//   harness DIR gemv KERNEL GEMV_BLOCKS QUANTIZE_BLOCKS ROWS COLS M SCALES_AT DS_OFFSET SCRATCH_BYTES
//     w.bin: the weights in the split layout; x.bin: m * cols f32. Runs quantize_q8_1, then
//     KERNEL; writes y.bin (m * rows f32).
//   harness DIR attention THREADS N_ROWS N_HEADS N_KV_HEADS HEAD_DIM BLOCK_SIZE SCALE
//     q.bin (f32 rows of n_heads * head_dim), k.bin / v.bin (f16 caches), pos.bin, rtab.bin,
//     tables.bin (i32); writes out.bin (f32, as q).
//   harness DIR attention_tiled N_TILES N_ROWS N_HEADS N_KV_HEADS HEAD_DIM BLOCK_SIZE SCALE
//     the same inputs and tiles.bin (i32, N_TILES + 1); runs paged_attention_tiled.
#include "shim.h"
#include "../../cuda/gemv.cu"
#include "../../cuda/attention.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

template <class F> void launch(unsigned grid_x, unsigned grid_y, unsigned threads, F body) {
    Block b(threads);
    block_state = &b;
    blockDim.x = threads;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; t++) {
        ts.emplace_back([&, t] {
            threadIdx.x = t;
            for (unsigned gy = 0; gy < grid_y; gy++) {
                for (unsigned gx = 0; gx < grid_x; gx++) {
                    blockIdx.x = gx;
                    blockIdx.y = gy;
                    body();
                    b.all.arrive_and_wait(); // the next block starts when this one is done
                }
            }
        });
    }
    for (auto& t : ts) t.join();
}

static std::vector<char> slurp(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) { std::fprintf(stderr, "cannot read %s\n", path.c_str()); std::exit(2); }
    return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

// 16-byte aligned, as device allocations are.
static std::vector<uint4> aligned(const std::vector<char>& bytes) {
    std::vector<uint4> out((bytes.size() + 15) / 16);
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
}

static void spill(const std::string& path, const std::vector<float>& v) {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

static int gemv(const std::string& dir, char** a) {
    std::string kernel = a[0];
    unsigned gemv_blocks = std::stoul(a[1]), quantize_blocks = std::stoul(a[2]);
    int rows = std::stoi(a[3]), cols = std::stoi(a[4]), m = std::stoi(a[5]);
    size_t scales_at = std::stoull(a[6]), ds_offset = std::stoull(a[7]), scratch_bytes = std::stoull(a[8]);
    std::vector<uint4> wbuf = aligned(slurp(dir + "/w.bin")), xbuf = aligned(slurp(dir + "/x.bin"));
    std::vector<uint4> scratch((scratch_bytes + 15) / 16);
    const float* x = reinterpret_cast<const float*>(xbuf.data());
    char* s = reinterpret_cast<char*>(scratch.data());
    const char* wp = reinterpret_cast<const char*>(wbuf.data());
    std::vector<float> y((size_t)m * rows, NAN);
    int nb = cols / 32, n_blocks = m * nb;
    launch(quantize_blocks, 1, 256, [&] {
        quantize_q8_1(x, reinterpret_cast<signed char*>(s), reinterpret_cast<float2*>(s + ds_offset), n_blocks);
    });
    auto qs = reinterpret_cast<const uint4*>(wp);
    auto xq = reinterpret_cast<const uint4*>(s);
    auto ds = reinterpret_cast<const float2*>(s + ds_offset);
    auto q41 = reinterpret_cast<const u32*>(wp + scales_at);
    auto q80 = reinterpret_cast<const u16*>(wp + scales_at);
    auto run = [&](auto body) { launch(gemv_blocks, 1, DP4A_THREADS, body); };
    if (kernel == "gemv_q4_1_dp4a_m1") run([&] { gemv_q4_1_dp4a_m1(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q4_1_dp4a_m2") run([&] { gemv_q4_1_dp4a_m2(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q4_1_dp4a_m4") run([&] { gemv_q4_1_dp4a_m4(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q4_1_dp4a_m8") run([&] { gemv_q4_1_dp4a_m8(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m1") run([&] { gemv_q8_0_dp4a_m1(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m2") run([&] { gemv_q8_0_dp4a_m2(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m4") run([&] { gemv_q8_0_dp4a_m4(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m8") run([&] { gemv_q8_0_dp4a_m8(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else { std::fprintf(stderr, "unknown kernel %s\n", kernel.c_str()); return 2; }
    spill(dir + "/y.bin", y);
    return 0;
}

// attention (tiled: false) or attention_tiled: a[0] is THREADS or N_TILES.
static int attention(const std::string& dir, char** a, bool tiled) {
    unsigned first = std::stoul(a[0]);
    int n_rows = std::stoi(a[1]), n_heads = std::stoi(a[2]), n_kv = std::stoi(a[3]);
    int head_dim = std::stoi(a[4]), block_size = std::stoi(a[5]);
    float scale = std::stof(a[6]);
    std::vector<uint4> q = aligned(slurp(dir + "/q.bin")), k = aligned(slurp(dir + "/k.bin")),
                       v = aligned(slurp(dir + "/v.bin")), pos = aligned(slurp(dir + "/pos.bin")),
                       rtab = aligned(slurp(dir + "/rtab.bin")), tables = aligned(slurp(dir + "/tables.bin"));
    long long stride = (long long)n_heads * head_dim;
    std::vector<float> out((size_t)n_rows * stride, NAN);
    auto qp = reinterpret_cast<const float*>(q.data());
    auto kp = reinterpret_cast<const u16*>(k.data());
    auto vp = reinterpret_cast<const u16*>(v.data());
    auto pp = reinterpret_cast<const int*>(pos.data());
    auto rp = reinterpret_cast<const int*>(rtab.data());
    auto tp = reinterpret_cast<const int*>(tables.data());
    if (tiled) {
        std::vector<uint4> tiles = aligned(slurp(dir + "/tiles.bin"));
        auto tl = reinterpret_cast<const int*>(tiles.data());
        launch(first, n_heads, TILE_WARPS * 32, [&] {
            paged_attention_tiled(qp, stride, out.data(), stride, kp, vp, pp, rp, tp, tl, n_heads,
                                  n_kv, head_dim, block_size, scale);
        });
    } else {
        launch(n_rows, n_heads, first, [&] {
            paged_attention(qp, stride, out.data(), stride, kp, vp, pp, rp, tp, n_heads, n_kv,
                            head_dim, block_size, scale);
        });
    }
    spill(dir + "/out.bin", out);
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 3 && std::string(argv[2]) == "gemv" && argc == 12) return gemv(argv[1], argv + 3);
    if (argc >= 3 && std::string(argv[2]) == "attention" && argc == 10) return attention(argv[1], argv + 3, false);
    if (argc >= 3 && std::string(argv[2]) == "attention_tiled" && argc == 10) return attention(argv[1], argv + 3, true);
    std::fprintf(stderr, "usage: see harness.cpp\n");
    return 2;
}
