//! AVX-512 VNNI kernel for the integer path, on the panel layout of `quant/panel.rs`.
//!
//! A panel block holds, for 16 weight rows and 32 columns, vectors whose lane `i` is row `i`'s
//! four quant bytes for columns `4g..4g+4`. So `vpdpbusd(acc, w[g], broadcast(act dword g))`
//! adds each row's 4-term dot product into its own lane; after 8 steps lane `i` holds row
//! `i`'s exact block dot product — no horizontal sums — and the f32 scaling is one FMA per 16
//! outputs. The canonical per-output arithmetic of `quantized.rs` falls out lane by lane.
//!
//! Each panel block is loaded once per tile of up to 8 activation rows and reused across
//! them (the panel, ~10-30 KB, stays in L1 while the activation tiles stream past). Under
//! `Isa::Amx`, whole tiles of 16 activation rows go to `amx.rs` instead, with the same
//! arithmetic.

use super::act::{ActBlock, ActTile};
use super::amx::{self, BBlock};
use super::quantized::{Panel, QKind};
use crate::cpu::par::{return_scratch, take_scratch};
use crate::quant::panel_block_bytes;
use crate::quant::WeightFormat;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// One 32-column block of a 16-row panel, ready for `vpdpbusd`: unsigned bytes (Q4 nibbles,
/// or Q8 values + 128), the row scales `d` and (Q4) offsets `m`.
struct WBlock {
    w: [__m512i; 8],
    d: __m512,
    m: __m512,
}

const KIND_Q4_0: u8 = 0;
const KIND_Q4_1: u8 = 1;
const KIND_Q8_0: u8 = 2;

/// Activation rows per tile: 8 accumulators + 8 weight vectors + scales fit the 32 registers.
const TILE: usize = 8;

/// How far ahead of the block being read `tile` prefetches the panel stream.
const PREFETCH_BYTES: usize = 2048;

thread_local! {
    static PACKED: RefCell<Vec<BBlock>> = const { RefCell::new(Vec::new()) };
}

/// Computes `out[a * ldo + r]` for all `acts.len() / nb` activation rows and the panel's rows.
/// When `tiles` is non-empty (AMX in use), it holds every whole tile of 16 activation rows
/// as [`ActTile`]s, and those rows go through the AMX kernel.
///
/// # Safety
/// The CPU must support the `Isa::Avx512` features (and AMX when `tiles` is non-empty); `out`
/// must be valid for those writes.
pub(super) unsafe fn panel(
    p: &Panel,
    acts: &[ActBlock],
    tiles: &[ActTile],
    out: *mut f32,
    ldo: usize,
) {
    let m = acts.len() / p.nb;
    // SAFETY: forwarded from the caller.
    unsafe {
        match p.kind {
            QKind::Q4_0 => dispatch::<KIND_Q4_0>(p, acts, tiles, m, out, ldo),
            QKind::Q4_1 => dispatch::<KIND_Q4_1>(p, acts, tiles, m, out, ldo),
            QKind::Q8_0 => dispatch::<KIND_Q8_0>(p, acts, tiles, m, out, ldo),
        }
    }
}

/// Unpacks the panel into AMX B tiles and runs the first `m / 16 * 16` rows through AMX;
/// returns how many rows it did.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn amx_rows<const KIND: u8>(
    p: &Panel,
    tiles: &[ActTile],
    m: usize,
    out: *mut f32,
    ldo: usize,
) -> usize {
    let m16 = m / 16 * 16;
    assert!(tiles.len() >= m16 / 16 * p.nb);
    let pbb = panel_block_bytes(format_of(KIND));
    let mut packed = take_scratch(&PACKED);
    packed.clear();
    packed.resize(p.nb, BBlock::default());
    // SAFETY: every block lies in `p.blocks` (checked by the caller); `out` as promised.
    unsafe {
        for (b, dst) in packed.iter_mut().enumerate() {
            let blk = p.blocks.as_ptr().add(b * pbb);
            prefetch_block(blk.wrapping_add(PREFETCH_BYTES), pbb);
            let wb = load_block::<KIND>(blk);
            // Q8_0 goes back to signed bytes for `tdpbssd` (no bias correction needed).
            let unbias = if KIND == KIND_Q8_0 { -128 } else { 0 };
            for (g, w) in wb.w.iter().enumerate() {
                let w = _mm512_xor_si512(*w, _mm512_set1_epi8(unbias));
                _mm512_storeu_si512(dst.w[g].as_mut_ptr().cast(), w);
            }
            _mm512_storeu_ps(dst.d.as_mut_ptr(), wb.d);
            _mm512_storeu_ps(dst.m.as_mut_ptr(), wb.m);
        }
        if KIND == KIND_Q8_0 {
            amx::panel::<true>(p, &packed, tiles, m16, out, ldo);
        } else {
            amx::panel::<false>(p, &packed, tiles, m16, out, ldo);
        }
    }
    return_scratch(&PACKED, packed);
    m16
}

fn format_of(kind: u8) -> WeightFormat {
    match kind {
        KIND_Q4_0 => WeightFormat::Q4_0,
        KIND_Q4_1 => WeightFormat::Q4_1,
        _ => WeightFormat::Q8_0,
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")]
unsafe fn dispatch<const KIND: u8>(
    p: &Panel,
    acts: &[ActBlock],
    tiles: &[ActTile],
    m: usize,
    out: *mut f32,
    ldo: usize,
) {
    assert!(p.blocks.len() >= p.nb * panel_block_bytes(format_of(KIND)));
    assert!(acts.len() >= m * p.nb);
    let mut a = 0;
    // SAFETY: each tile reads C activation rows from `a` and writes C output rows.
    unsafe {
        if !tiles.is_empty() && m >= 16 {
            a = amx_rows::<KIND>(p, tiles, m, out, ldo);
        }
        while a + TILE <= m {
            tile::<KIND, TILE>(p, &acts[a * p.nb..], out.add(a * ldo), ldo);
            a += TILE;
        }
        let (rest, o) = (&acts[a * p.nb..], out.add(a * ldo));
        match m - a {
            0 => {}
            1 => tile::<KIND, 1>(p, rest, o, ldo),
            2 => tile::<KIND, 2>(p, rest, o, ldo),
            3 => tile::<KIND, 3>(p, rest, o, ldo),
            4 => tile::<KIND, 4>(p, rest, o, ldo),
            5 => tile::<KIND, 5>(p, rest, o, ldo),
            6 => tile::<KIND, 6>(p, rest, o, ldo),
            _ => tile::<KIND, 7>(p, rest, o, ldo),
        }
    }
}

/// Prefetches the `len` bytes at `at` into L1. The weights stream from memory (or a shared
/// L3) faster with these explicit requests than on the hardware prefetchers alone. Callers
/// prefetch ahead of the block they read; past a panel's end that is the next panel, which
/// the same thread usually takes next. Prefetches never fault, so running past the matrix
/// is harmless.
#[inline(always)]
fn prefetch_block(at: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        // SAFETY: a prefetch is a hint; it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(off).cast()) };
        off += 64;
    }
}

/// Loads panel block `blk`: four (Q4) or eight (Q8) 64-byte quant vectors plus the scales.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn load_block<const KIND: u8>(blk: *const u8) -> WBlock {
    // SAFETY: the caller passes a whole panel block.
    unsafe {
        let ld = |off: usize| blk.add(off).cast::<__m512i>();
        let half = |off: usize| blk.add(off).cast::<__m256i>();
        let mut w = [_mm512_setzero_si512(); 8];
        if KIND == KIND_Q8_0 {
            for (g, v) in w.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(ld(64 * g));
            }
            WBlock {
                w,
                d: _mm512_cvtph_ps(_mm256_loadu_si256(half(512))),
                m: _mm512_setzero_ps(),
            }
        } else {
            let nib = _mm512_set1_epi8(0x0F);
            for g in 0..4 {
                let v = _mm512_loadu_si512(ld(64 * g));
                w[g] = _mm512_and_si512(v, nib);
                w[g + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(half(256)));
            let m = if KIND == KIND_Q4_1 {
                _mm512_cvtph_ps(_mm256_loadu_si256(half(288)))
            } else {
                _mm512_mul_ps(d, _mm512_set1_ps(-8.0))
            };
            WBlock { w, d, m }
        }
    }
}

/// `acc += ` one block's contribution for one activation row, in the canonical order.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni,fma")]
unsafe fn update<const KIND: u8>(acc: __m512, wb: &WBlock, a: &ActBlock) -> __m512 {
    let q = a.q.as_ptr().cast::<i32>();
    // Two independent dpbusd chains (columns 0..16 and 16..32) halve the latency; the int32
    // sums are exact, so splitting does not change the result.
    let mut i0 = if KIND == KIND_Q8_0 {
        _mm512_set1_epi32(a.corr)
    } else {
        _mm512_setzero_si512()
    };
    let mut i1 = _mm512_setzero_si512();
    for g in 0..4 {
        // SAFETY: `a.q` is 32 bytes = 8 dwords.
        let (x0, x1) = unsafe { (q.add(g).read_unaligned(), q.add(g + 4).read_unaligned()) };
        i0 = _mm512_dpbusd_epi32(i0, wb.w[g], _mm512_set1_epi32(x0));
        i1 = _mm512_dpbusd_epi32(i1, wb.w[g + 4], _mm512_set1_epi32(x1));
    }
    let i = _mm512_add_epi32(i0, i1);
    let scale = _mm512_mul_ps(wb.d, _mm512_set1_ps(a.d));
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, acc);
    if KIND == KIND_Q8_0 {
        acc
    } else {
        _mm512_fmadd_ps(wb.m, _mm512_set1_ps(a.s), acc)
    }
}

/// `C` activation rows (from `acts`, `nb` blocks each) against the whole panel.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn tile<const KIND: u8, const C: usize>(
    p: &Panel,
    acts: &[ActBlock],
    out: *mut f32,
    ldo: usize,
) {
    let nb = p.nb;
    let pbb = panel_block_bytes(format_of(KIND));
    assert!(acts.len() >= C * nb);
    let mut acc = [_mm512_setzero_ps(); C];
    // SAFETY: block b lies inside `p.blocks` (checked by the caller); activation indices are
    // below C * nb <= acts.len(); the caller owns C output rows of `p.rows` floats.
    unsafe {
        for b in 0..nb {
            let blk = p.blocks.as_ptr().add(b * pbb);
            prefetch_block(blk.wrapping_add(PREFETCH_BYTES), pbb);
            let wb = load_block::<KIND>(blk);
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc = update::<KIND>(*acc, &wb, acts.get_unchecked(c * nb + b));
            }
        }
        let mask = ((1u32 << p.rows) - 1) as u16;
        for (c, &v) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(c * ldo), mask, v);
        }
    }
}
