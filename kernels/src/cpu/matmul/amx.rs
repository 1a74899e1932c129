//! AMX-INT8 kernel for the integer path: 16 activation rows x 16 weight rows per tile.
//!
//! Per 32-column block, `tdpbsud` (signed activations x unsigned Q4 nibbles) or `tdpbssd`
//! (x signed Q8 bytes) produces the exact int32 block dot products of a 16x16 tile in one
//! instruction; the tile is stored and each
//! row is scaled into its f32 accumulator exactly as the VNNI kernel does (same int32 sums,
//! same FMA sequence), so results are bit-identical to it and to the portable reference.
//! The weight B tile is the panel block's unpacked bytes: 8 rows of 64 bytes, row `g` holding
//! every weight row's bytes for columns `4g..4g+4` — the VNNI layout of `quant/panel.rs`.
//!
//! Tiles are configured per call and released afterwards; Linux must grant the process the
//! tile-data state first (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), which
//! [`supported`] requests once.

use super::act::ActTile;
use super::quantized::Panel;
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether AMX-INT8 can be used: CPU support, OS-enabled tile state, and Linux permission.
pub(crate) fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(detect)
}

#[cfg(target_os = "linux")]
fn detect() -> bool {
    const AMX_TILE: u32 = 1 << 24;
    const AMX_INT8: u32 = 1 << 25;
    const OSXSAVE: u32 = 1 << 27;
    const XTILE_STATE: u64 = 3 << 17;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    const SYS_ARCH_PRCTL: u64 = 158;
    let (l7, l1) = (__cpuid_count(7, 0), __cpuid(1));
    if l7.edx & (AMX_TILE | AMX_INT8) != AMX_TILE | AMX_INT8 || l1.ecx & OSXSAVE == 0 {
        return false;
    }
    let (lo, hi): (u32, u32);
    // SAFETY: xgetbv is available when OSXSAVE is set (checked above).
    unsafe { asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    if ((hi as u64) << 32 | lo as u64) & XTILE_STATE != XTILE_STATE {
        return false;
    }
    let ret: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only updates this process's permitted xstate.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as i64 => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        )
    };
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn detect() -> bool {
    false
}

/// `ldtilecfg` layout (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    _reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
    _reserved2: [u8; 16],
}

/// Two sets of (C, A, B) tiles, alternated between blocks so one block's `tdpbsud` overlaps
/// the previous block's scaling. C: 16 x 16 i32; A: 16 activation rows x 32 bytes;
/// B: 8 x 64 bytes.
const CONFIG: TileConfig = {
    let mut c = TileConfig {
        palette: 1,
        start_row: 0,
        _reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
        _reserved2: [0; 16],
    };
    let shapes = [(16, 64), (16, 32), (8, 64)];
    let mut t = 0;
    while t < 6 {
        c.rows[t] = shapes[t % 3].0;
        c.colsb[t] = shapes[t % 3].1;
        t += 1;
    }
    c
};

/// One block's weights unpacked for the B tile, with f32 scales.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct BBlock {
    pub w: [[u8; 64]; 8],
    pub d: [f32; 16],
    pub m: [f32; 16],
}

impl Default for BBlock {
    fn default() -> Self {
        BBlock {
            w: [[0; 64]; 8],
            d: [0.0; 16],
            m: [0.0; 16],
        }
    }
}

/// Tile product of one block into `c` (16 x 16 i32), on tile set `SET`. `Q8` multiplies
/// signed weights (`tdpbssd`), else unsigned nibbles (`tdpbsud`); activations are signed.
#[inline(always)]
unsafe fn dot_block<const SET: u8, const Q8: bool>(
    a: *const u8,
    a_stride: usize,
    b: *const u8,
    c: *mut i32,
) {
    macro_rules! tiles {
        ($dp:literal, $c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tilezero ", $c),
                concat!("tileloadd ", $a, ", [{a} + {sa}*1]"),
                concat!("tileloadd ", $b, ", [{b} + {sb}*1]"),
                concat!($dp, " ", $c, ", ", $a, ", ", $b),
                concat!("tilestored [{c} + {sb}*1], ", $c),
                a = in(reg) a, sa = in(reg) a_stride, b = in(reg) b, sb = in(reg) 64usize,
                c = in(reg) c, options(nostack),
            )
        };
    }
    // SAFETY: the caller passes 16 readable A rows of 32 bytes `a_stride` apart, 8 B rows of
    // 64 bytes and a 1 KB C buffer; tiles were configured by `ldtilecfg`.
    unsafe {
        match (SET, Q8) {
            (0, true) => tiles!("tdpbssd", "tmm0", "tmm1", "tmm2"),
            (0, false) => tiles!("tdpbsud", "tmm0", "tmm1", "tmm2"),
            (_, true) => tiles!("tdpbssd", "tmm3", "tmm4", "tmm5"),
            (_, false) => tiles!("tdpbsud", "tmm3", "tmm4", "tmm5"),
        }
    }
}

/// Repeats `$body` with `$r` bound to 0..16 as a constant, so the 16 accumulators stay in
/// registers and every activation scale is a broadcast at a constant offset.
macro_rules! unroll16 {
    ($r:ident => $body:block) => {
        unroll16!(@ $r $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@ $r:ident $body:block; $($n:literal)*) => {
        $({
            const $r: usize = $n;
            $body
        })*
    };
}

/// Scales one block's 16x16 int32 tile into the 16 accumulators (canonical order).
#[inline(always)]
unsafe fn scale_block<const Q8: bool>(
    acc: &mut [__m512; 16],
    c: *const i32,
    wb: &BBlock,
    ts: &ActTile,
) {
    // SAFETY: `c` is a 16x16 tile.
    unsafe {
        let d = _mm512_loadu_ps(wb.d.as_ptr());
        let m = _mm512_loadu_ps(wb.m.as_ptr());
        unroll16!(R => {
            let i = _mm512_loadu_si512(c.add(16 * R).cast());
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(ts.d[R]));
            acc[R] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, acc[R]);
            if !Q8 {
                acc[R] = _mm512_fmadd_ps(m, _mm512_set1_ps(ts.s[R]), acc[R]);
            }
        });
    }
}

/// `out[a * ldo + r]` for the first `m16` (a multiple of 16) activation rows, given as
/// [`ActTile`]s, with the panel's blocks unpacked into `packed` (Q8_0: signed).
///
/// # Safety
/// [`supported`] must have returned true and the CPU must have AVX-512 F and FMA; `out` must
/// be valid for `m16` rows of `p.rows` floats, `ldo` apart.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn panel<const Q8: bool>(
    p: &Panel,
    packed: &[BBlock],
    tiles: &[ActTile],
    m16: usize,
    out: *mut f32,
    ldo: usize,
) {
    let nb = p.nb;
    assert!(packed.len() == nb && nb > 0 && m16.is_multiple_of(16));
    assert!(tiles.len() >= m16 / 16 * nb);
    let stride = 32;
    let pbb = p.blocks.len() / nb;
    let next = p.blocks.as_ptr().wrapping_add(p.blocks.len());
    let mut cbuf = [[[0i32; 16]; 16]; 2];
    let mask = ((1u32 << p.rows) - 1) as u16;
    // SAFETY: tile loads read one activation tile block (16 x 32 bytes) and one packed block;
    // stores go to `cbuf`; `out` as promised by the caller.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
        for t in 0..m16 / 16 {
            let ts = &tiles[t * nb..(t + 1) * nb];
            let mut acc = [_mm512_setzero_ps(); 16];
            let c0 = cbuf[0].as_mut_ptr().cast();
            dot_block::<0, Q8>(
                ts[0].q.as_ptr().cast(),
                stride,
                packed[0].w.as_ptr().cast(),
                c0,
            );
            for b in 1..=nb {
                if t == 0 {
                    // Pull the next panel (usually this thread's next) into cache while the
                    // tile units work, so its unpacking does not wait on memory. Prefetches
                    // never fault, so running past the matrix is harmless.
                    let ahead = next.wrapping_add((b - 1) * pbb);
                    let mut off = 0;
                    while off < pbb {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off).cast());
                        off += 64;
                    }
                }
                // Start block b on the other tile set, then scale block b - 1.
                if b < nb {
                    let a = ts[b].q.as_ptr().cast();
                    let w = packed[b].w.as_ptr().cast();
                    let c = cbuf[b % 2].as_mut_ptr().cast();
                    if b % 2 == 0 {
                        dot_block::<0, Q8>(a, stride, w, c);
                    } else {
                        dot_block::<1, Q8>(a, stride, w, c);
                    }
                }
                let c = cbuf[(b - 1) % 2].as_ptr().cast();
                scale_block::<Q8>(&mut acc, c, &packed[b - 1], &ts[b - 1]);
            }
            unroll16!(R => {
                _mm512_mask_storeu_ps(out.add((16 * t + R) * ldo), mask, acc[R]);
            });
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}
