//! Which instruction set the kernels use.

use std::sync::OnceLock;

/// A kernel implementation, from the least to the most capable. Results are bit-identical
/// between them; `Portable` exists for other CPUs and so that tests can check the SIMD paths
/// against it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Plain Rust, no run-time feature requirements.
    Portable,
    /// AVX2 + FMA + F16C (x86-64, Haswell / Zen 1 and later): most laptops and older servers.
    Avx2,
    /// AVX-512 F/BW/DQ/VL + VNNI (x86-64, Ice Lake / Zen 4 and later).
    Avx512,
    /// `Avx512` plus AMX-INT8 tiles for integer matmuls of 16 or more activation rows
    /// (Sapphire Rapids and later, Linux).
    Amx,
}

/// Environment variable that caps [`Isa::detect`] (`portable`, `avx2`, `avx512`, `amx`):
/// to compare kernels on one machine, or to rule a kernel out.
pub const ISA_ENV: &str = "KVMESH_CPU_ISA";

impl Isa {
    /// The best implementation this CPU supports (detected once), capped by `KVMESH_CPU_ISA`.
    pub fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let best = [Isa::Amx, Isa::Avx512, Isa::Avx2]
                .into_iter()
                .find(|i| i.is_supported())
                .unwrap_or(Isa::Portable);
            match std::env::var(ISA_ENV) {
                Ok(name) => match Isa::from_name(&name) {
                    Some(cap) => best.min(cap),
                    None => {
                        eprintln!(
                            "{ISA_ENV}={name:?} is not one of portable, avx2, avx512, amx; \
                             using {best:?}"
                        );
                        best
                    }
                },
                Err(_) => best,
            }
        })
    }

    /// Parses `portable`, `avx2`, `avx512` or `amx` (any case).
    pub fn from_name(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "portable" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "amx" => Some(Isa::Amx),
            _ => None,
        }
    }

    /// Whether this CPU can run `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => avx2_supported(),
            Isa::Avx512 => avx512_supported(),
            Isa::Amx => avx512_supported() && super::matmul::amx_supported(),
        }
    }

    /// Whether the AVX-512 kernels run (`Avx512` or `Amx`).
    pub(crate) fn has_avx512(self) -> bool {
        self >= Isa::Avx512
    }

    /// Whether the AVX2 (or better) kernels run.
    pub(crate) fn has_avx2(self) -> bool {
        self >= Isa::Avx2
    }

    /// `self` if supported, else the best supported one below it: what the `*_with` entry
    /// points actually run.
    pub(crate) fn effective(self) -> Isa {
        match self {
            Isa::Amx if !self.is_supported() => Isa::Avx512.effective(),
            Isa::Avx512 if !self.is_supported() => Isa::Avx2.effective(),
            Isa::Avx2 if !self.is_supported() => Isa::Portable,
            other => other,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    avx2_supported()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_order_by_capability() {
        assert_eq!(Isa::from_name(" AVX2 "), Some(Isa::Avx2));
        assert_eq!(Isa::from_name("sse"), None);
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Amx);
        assert!(Isa::Amx.has_avx2() && !Isa::Avx2.has_avx512());
        assert!(Isa::Portable.effective() == Isa::Portable);
        assert!(Isa::Amx.effective().is_supported());
    }
}
