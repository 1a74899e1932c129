//! Which instruction set the kernels use.

use std::sync::OnceLock;

/// A kernel implementation. Results are bit-identical between them; `Portable` exists for
/// machines without AVX-512 and so that tests can check the SIMD paths against it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Plain Rust, no run-time feature requirements.
    Portable,
    /// AVX-512 F/BW/DQ/VL + VNNI (x86-64, Ice Lake / Zen 4 and later).
    Avx512,
    /// `Avx512` plus AMX-INT8 tiles for integer matmuls of 16 or more activation rows
    /// (Sapphire Rapids and later, Linux).
    Amx,
}

impl Isa {
    /// The best implementation this CPU supports (detected once).
    pub fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            [Isa::Amx, Isa::Avx512]
                .into_iter()
                .find(|i| i.is_supported())
                .unwrap_or(Isa::Portable)
        })
    }

    /// Whether this CPU can run `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx512 => avx512_supported(),
            Isa::Amx => avx512_supported() && super::matmul::amx_supported(),
        }
    }

    /// Whether the AVX-512 kernels run (`Avx512` or `Amx`).
    pub(crate) fn has_avx512(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Amx)
    }

    /// `self` if supported, else the best supported one below it: what the `*_with` entry
    /// points actually run.
    pub(crate) fn effective(self) -> Isa {
        match self {
            Isa::Amx if !self.is_supported() => Isa::Avx512.effective(),
            Isa::Avx512 if !self.is_supported() => Isa::Portable,
            other => other,
        }
    }
}

/// Whether the plain-Rust kernels may be compiled for AVX2 + FMA + F16C (see `simd.rs`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}
