//! The CPU backend: SIMD kernels chosen at run time (`is_x86_feature_detected!`), a portable
//! fallback with the same arithmetic, and rayon's global pool for threading.
//!
//! Every op defines one canonical order of floating-point operations per output element, and
//! both the AVX-512 and the portable paths follow it. So results are bit-identical across
//! ISAs, across batch sizes and across tilings: a sequence's output never depends on what it
//! was batched with.
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
pub use isa::Isa;
pub use matmul::{matmul, matmul_with};
pub use norm::{add_in_place, rmsnorm, silu_mul, softmax};
pub use rope::rope;
