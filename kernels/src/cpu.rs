//! The CPU backend: SIMD kernels chosen at run time ([`Isa::detect`]: AVX2 + FMA + F16C,
//! AVX-512 + VNNI, and AMX tiles for batched integer matmuls where Linux grants them), a
//! portable fallback with the same arithmetic, and rayon's global pool for threading.
//!
//! Every op defines one canonical order of floating-point operations per output element, and
//! every path follows it. So results are bit-identical across ISAs, across batch sizes and
//! across tilings: a sequence's output never depends on what it was batched with.
//!
//! Callers that issue many small ops (decode) should run their step on a rayon worker
//! (`ThreadPool::install`, or `rayon::scope`): ops called from outside the pool pay a
//! cross-thread wake-up each.
//!
//! Preconditions (shapes, lengths) are checked with `assert!`; non-finite inputs give
//! unspecified but non-panicking results.

mod attention;
mod exp;
mod isa;
mod lanes;
mod matmul;
mod norm;
mod par;
mod rope;
mod simd;

pub use attention::{
    paged_attention, paged_attention_with, write_kv, AttentionSeq, AttentionShape,
};
pub use isa::{Isa, ISA_ENV};
pub use matmul::{matmul, matmul_with};
pub use norm::{add_in_place, rmsnorm, silu_mul, softmax};
pub use rope::{rope, rope_table, rope_with};
