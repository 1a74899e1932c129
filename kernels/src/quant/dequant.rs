//! Scalar dequantization, operation for operation as ggml's `dequantize_row_*` (so results are
//! bit-identical to ggml's reference C code).

use super::WeightFormat;
use half::{bf16, f16};

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `out.len()` elements from `src`, which holds exactly the blocks covering them.
/// Panics if `out.len()` is not a whole number of blocks or `src` is too short.
pub(crate) fn dequantize_blocks(format: WeightFormat, src: &[u8], out: &mut [f32]) {
    let be = format.block_elems();
    let bb = format.block_bytes();
    assert!(out.len().is_multiple_of(be), "dequantize: partial block");
    let src = &src[..out.len() / be * bb];
    match format {
        WeightFormat::F32 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightFormat::F16 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightFormat::BF16 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightFormat::Q8_0 => {
            for (y, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
                    *yj = q as i8 as f32 * d;
                }
            }
        }
        WeightFormat::Q4_0 => {
            for (y, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    let q = b[2 + j];
                    y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        WeightFormat::Q4_1 => {
            for (y, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(bb)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    let q = b[4 + j];
                    y[j] = (q & 0xF) as f32 * d + m;
                    y[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        WeightFormat::Q4_K => {
            for (y, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(bb)) {
                dequant_q4_k(b, y);
            }
        }
        WeightFormat::Q6_K => {
            for (y, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(bb)) {
                dequant_q6_k(b, y);
            }
        }
    }
}

/// ggml `get_scale_min_k4`: 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, rest) = b.split_at(128);
    let (qh, rest) = rest.split_at(64);
    let (sc, d) = rest.split_at(16);
    let d = f16_at(d, 0);
    for half in 0..2 {
        let ql = &ql[64 * half..];
        let qh = &qh[32 * half..];
        let sc = &sc[8 * half..];
        let y = &mut y[128 * half..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |i: usize| d * sc[is + i] as i8 as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q4_1_hand_block() {
        // d = 0.5, m = -1: low nibble j -> 0.5*j - 1, high nibble -> 0.5*(15-j) - 1.
        let mut b = Vec::new();
        b.extend(h(0.5));
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0.0; 32];
        dequantize_blocks(WeightFormat::Q4_1, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 * j as f32 - 1.0);
            assert_eq!(y[j + 16], 0.5 * (15 - j) as f32 - 1.0);
        }
    }

    #[test]
    fn q4_0_hand_block() {
        let mut b = Vec::new();
        b.extend(h(2.0));
        b.extend((0..16u8).map(|j| j | (3 << 4)));
        let mut y = [0.0; 32];
        dequantize_blocks(WeightFormat::Q4_0, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 2.0 * (j as f32 - 8.0));
            assert_eq!(y[j + 16], -10.0);
        }
    }

    #[test]
    fn q8_0_hand_block() {
        let mut b = Vec::new();
        b.extend(h(0.25));
        b.extend((0..32i32).map(|j| (j * 8 - 128) as i8 as u8));
        let mut y = [0.0; 32];
        dequantize_blocks(WeightFormat::Q8_0, &b, &mut y);
        for (j, &v) in y.iter().enumerate() {
            assert_eq!(v, 0.25 * (j as f32 * 8.0 - 128.0));
        }
    }

    #[test]
    fn q4_k_hand_block() {
        // Sub-block scales 1..=8, mins 8..=1 through the 6-bit packing of get_scale_min_k4.
        let sc: [u8; 8] = [1, 2, 3, 4, 40, 50, 60, 63];
        let mn: [u8; 8] = [8, 7, 6, 5, 33, 22, 11, 0];
        let mut scales = [0u8; 12];
        for j in 0..4 {
            scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            scales[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &scales), (sc[j], mn[j]));
        }
        let mut b = Vec::new();
        b.extend(h(0.5));
        b.extend(h(0.25));
        b.extend(scales);
        b.extend((0..128u32).map(|i| (i % 16) as u8 | (((i / 7) % 16) as u8) << 4));
        assert_eq!(b.len(), 144);
        let mut y = [0.0; 256];
        dequantize_blocks(WeightFormat::Q4_K, &b, &mut y);
        for (i, &got) in y.iter().enumerate() {
            let (chunk, within) = (i / 64, i % 64);
            let sub = 2 * chunk + within / 32;
            let byte = 32 * chunk + within % 32;
            let q = if within < 32 {
                byte % 16
            } else {
                (byte / 7) % 16
            };
            let want = 0.5 * sc[sub] as f32 * q as f32 - 0.25 * mn[sub] as f32;
            assert_eq!(got, want, "elem {i}");
        }
    }

    #[test]
    fn q6_k_hand_block() {
        // Element i gets the 6-bit code (i * 5) % 64, sub-block scale (s - 8) for s = i / 16.
        let code = |i: usize| ((i * 5) % 64) as u8;
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for half in 0..2 {
            for l in 0..32 {
                let c = |k: usize| code(128 * half + l + 32 * k);
                ql[64 * half + l] = (c(0) & 0xF) | ((c(2) & 0xF) << 4);
                ql[64 * half + l + 32] = (c(1) & 0xF) | ((c(3) & 0xF) << 4);
                qh[32 * half + l] =
                    (c(0) >> 4) | ((c(1) >> 4) << 2) | ((c(2) >> 4) << 4) | ((c(3) >> 4) << 6);
            }
        }
        let mut b = Vec::new();
        b.extend(ql);
        b.extend(qh);
        b.extend((0..16i8).map(|s| (s - 8) as u8));
        b.extend(h(0.125));
        assert_eq!(b.len(), 210);
        let mut y = [0.0; 256];
        dequantize_blocks(WeightFormat::Q6_K, &b, &mut y);
        for (i, &v) in y.iter().enumerate() {
            let want = 0.125 * ((i / 16) as f32 - 8.0) * (code(i) as f32 - 32.0);
            assert_eq!(v, want, "elem {i}");
        }
    }

    #[test]
    fn float_formats() {
        let vals = [1.5f32, -2.25, 0.0, 65504.0];
        let mut y = [0.0; 4];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        dequantize_blocks(WeightFormat::F32, &f32b, &mut y);
        assert_eq!(y, vals);
        let f16b: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
        dequantize_blocks(WeightFormat::F16, &f16b, &mut y);
        assert_eq!(y, vals);
        let bfb: Vec<u8> = [1.5f32, -2.25, 0.0, 256.0]
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        dequantize_blocks(WeightFormat::BF16, &bfb, &mut y);
        assert_eq!(y, [1.5, -2.25, 0.0, 256.0]);
    }
}
