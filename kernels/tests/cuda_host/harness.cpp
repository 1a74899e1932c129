// Runs gemv.cu's quantize_q8_1 and one of its GEMV kernels on the host through shim.h, as
// CudaDevice::matmul launches them, on the inputs kernels/tests/gemv_host.rs writes:
//   harness DIR KERNEL GEMV_BLOCKS QUANTIZE_BLOCKS ROWS COLS M SCALES_AT DS_OFFSET SCRATCH_BYTES
// DIR/w.bin: the weights in the split layout; DIR/x.bin: m * cols f32. Writes DIR/y.bin.
#include "shim.h"
#include "../../cuda/gemv.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

template <class F> void launch(unsigned grid, unsigned threads, F body) {
    Block b(threads);
    block_state = &b;
    blockDim.x = threads;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; t++) {
        ts.emplace_back([&, t] {
            threadIdx.x = t;
            for (unsigned g = 0; g < grid; g++) {
                blockIdx.x = g;
                body();
                b.all.arrive_and_wait(); // the next block starts when this one is done
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

int main(int argc, char** argv) {
    if (argc != 11) { std::fprintf(stderr, "usage: see harness.cpp\n"); return 2; }
    std::string dir = argv[1], kernel = argv[2];
    unsigned gemv_blocks = std::stoul(argv[3]), quantize_blocks = std::stoul(argv[4]);
    int rows = std::stoi(argv[5]), cols = std::stoi(argv[6]), m = std::stoi(argv[7]);
    size_t scales_at = std::stoull(argv[8]), ds_offset = std::stoull(argv[9]), scratch_bytes = std::stoull(argv[10]);
    std::vector<char> w = slurp(dir + "/w.bin"), xb = slurp(dir + "/x.bin");
    // 16-byte aligned copies, as device allocations are.
    std::vector<uint4> wbuf((w.size() + 15) / 16), scratch((scratch_bytes + 15) / 16);
    std::memcpy(wbuf.data(), w.data(), w.size());
    const float* x = reinterpret_cast<const float*>(xb.data());
    char* s = reinterpret_cast<char*>(scratch.data());
    const char* wp = reinterpret_cast<const char*>(wbuf.data());
    std::vector<float> y((size_t)m * rows, NAN);
    int nb = cols / 32, n_blocks = m * nb;
    launch(quantize_blocks, 256, [&] {
        quantize_q8_1(x, reinterpret_cast<signed char*>(s), reinterpret_cast<float2*>(s + ds_offset), n_blocks);
    });
    auto qs = reinterpret_cast<const uint4*>(wp);
    auto xq = reinterpret_cast<const uint4*>(s);
    auto ds = reinterpret_cast<const float2*>(s + ds_offset);
    auto q41 = reinterpret_cast<const u32*>(wp + scales_at);
    auto q80 = reinterpret_cast<const u16*>(wp + scales_at);
    auto run = [&](auto body) { launch(gemv_blocks, DP4A_THREADS, body); };
    if (kernel == "gemv_q4_1_dp4a_m1") run([&] { gemv_q4_1_dp4a_m1(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q4_1_dp4a_m2") run([&] { gemv_q4_1_dp4a_m2(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q4_1_dp4a_m4") run([&] { gemv_q4_1_dp4a_m4(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q4_1_dp4a_m8") run([&] { gemv_q4_1_dp4a_m8(qs, q41, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m1") run([&] { gemv_q8_0_dp4a_m1(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m2") run([&] { gemv_q8_0_dp4a_m2(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m4") run([&] { gemv_q8_0_dp4a_m4(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else if (kernel == "gemv_q8_0_dp4a_m8") run([&] { gemv_q8_0_dp4a_m8(qs, q80, xq, ds, y.data(), rows, nb, m); });
    else { std::fprintf(stderr, "unknown kernel %s\n", kernel.c_str()); return 2; }
    std::ofstream(dir + "/y.bin", std::ios::binary).write(reinterpret_cast<const char*>(y.data()), y.size() * 4);
    return 0;
}
