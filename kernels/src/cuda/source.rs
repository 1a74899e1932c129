//! The kernel sources, embedded in the binary, and the numbering they share with Rust.

use crate::WeightFormat;

/// One `.cu` file under `kernels/cuda/`, and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
    pub kernels: &'static [&'static str],
}

/// Helpers every source is compiled with (prepended: NVRTC has no include path here).
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// Every kernel source. A test compiles each of them with NVRTC, so one that does not compile
/// fails CI, and checks that each listed kernel is in the PTX.
pub const SOURCES: &[Source] = &[
    Source {
        name: "elementwise.cu",
        text: include_str!("../../cuda/elementwise.cu"),
        kernels: &[
            "rmsnorm_f32",
            "add_f32",
            "add_rows_f32",
            "silu_mul_f32",
            "embed_rows",
            "f32_to_bf16",
        ],
    },
    Source {
        name: "quant.cu",
        text: include_str!("../../cuda/quant.cu"),
        kernels: &["gemv_q8_0", "gemv_q4_1", "dequant_bf16", "dequant_f16"],
    },
    Source {
        name: "gemv.cu",
        text: include_str!("../../cuda/gemv.cu"),
        kernels: &super::layout::DP4A_KERNELS,
    },
    Source {
        name: "rope.cu",
        text: include_str!("../../cuda/rope.cu"),
        kernels: &["rope_f32"],
    },
    Source {
        name: "kv.cu",
        text: include_str!("../../cuda/kv.cu"),
        kernels: &["kv_append", "kv_pack", "kv_unpack"],
    },
    Source {
        name: "attention.cu",
        text: include_str!("../../cuda/attention.cu"),
        kernels: &["paged_attention", "paged_attention_tiled"],
    },
    Source {
        name: "sample.cu",
        text: include_str!("../../cuda/sample.cu"),
        kernels: &["argmax_rows", "sample_rows"],
    },
];

impl Source {
    /// The translation unit NVRTC compiles: the common helpers, then this source.
    pub fn unit(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.name, self.text)
    }
}

/// The code of a weight format in the kernels (`FMT_*` in `common.cuh`); `None` for formats the
/// device kernels do not read (K-quants: dequantize them on the host first).
pub fn format_code(f: WeightFormat) -> Option<i32> {
    match f {
        WeightFormat::F32 => Some(0),
        WeightFormat::F16 => Some(1),
        WeightFormat::BF16 => Some(2),
        WeightFormat::Q8_0 => Some(3),
        WeightFormat::Q4_0 => Some(4),
        WeightFormat::Q4_1 => Some(5),
        WeightFormat::Q4_K | WeightFormat::Q6_K => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_kernel_is_defined_in_its_source() {
        for s in SOURCES {
            for k in s.kernels {
                let decl = format!("__global__ void {k}(");
                assert!(s.text.contains(&decl), "{} lacks {k}", s.name);
            }
            let defined = s.text.matches("__global__ void").count();
            assert_eq!(defined, s.kernels.len(), "{}: unlisted kernels", s.name);
        }
    }

    /// The constants layout.rs shares with gemv.cu (its geometry and its instantiations),
    /// attention.cu and quant.cu.
    #[test]
    fn gemv_geometry_matches_its_source() {
        use super::super::layout::{DP4A_MAX_M, DP4A_ROWS, DP4A_THREADS, GEMV_MAX_M};
        let gemv = SOURCES.iter().find(|s| s.name == "gemv.cu").unwrap().text;
        assert!(gemv.contains(&format!("#define DP4A_THREADS {DP4A_THREADS}\n")));
        assert!(gemv.contains(&format!("#define DP4A_ROWS {DP4A_ROWS}\n")));
        for max_m in DP4A_MAX_M {
            for f in ["q4_1", "q8_0"] {
                let wrapper = format!("void gemv_{f}_dp4a_m{max_m}(");
                let body = format!("{{ gemv_{f}_dp4a<{max_m}>(");
                let line = gemv.lines().find(|l| l.contains(&wrapper)).unwrap();
                assert!(line.contains(&body), "{line}");
            }
        }
        let attention = SOURCES
            .iter()
            .find(|s| s.name == "attention.cu")
            .unwrap()
            .text;
        let max_warps = super::super::layout::ATTN_MAX_WARPS;
        assert!(attention.contains(&format!("#define ATTN_MAX_WARPS {max_warps}\n")));
        let quant = SOURCES.iter().find(|s| s.name == "quant.cu").unwrap().text;
        assert!(quant.contains(&format!("#define GEMV_MAX_M {GEMV_MAX_M}\n")));
        assert_eq!(DP4A_MAX_M.last(), Some(&GEMV_MAX_M));
    }

    #[test]
    fn format_codes_match_common() {
        for (f, name) in [
            (WeightFormat::F32, "FMT_F32"),
            (WeightFormat::F16, "FMT_F16"),
            (WeightFormat::BF16, "FMT_BF16"),
            (WeightFormat::Q8_0, "FMT_Q8_0"),
            (WeightFormat::Q4_0, "FMT_Q4_0"),
            (WeightFormat::Q4_1, "FMT_Q4_1"),
        ] {
            let line = format!("#define {name} {}", format_code(f).unwrap());
            assert!(COMMON.contains(&line), "{line}");
        }
    }
}
