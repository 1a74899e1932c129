//! Compute backends for kvmesh: the CPU backend (always present; SIMD with runtime feature
//! detection, rayon across rows/heads) and the CUDA backend (feature `cuda`; a stub otherwise).
//!
//! All ops work on host slices in row-major order. Results for one row of a batched op are
//! bit-identical whatever other rows are in the batch (batch invariance), so a sequence's
//! greedy output does not depend on what it was batched with.

pub mod cpu;
pub mod cuda;
pub mod quant;

pub use quant::{QMatrix, WeightFormat};
