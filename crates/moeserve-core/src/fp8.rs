//! float8 e4m3 (`float8_e4m3fn`: 4 exponent bits of bias 7, 3 mantissa bits, no infinities,
//! `0x7f` / `0xff` NaN), the element of FP8 block checkpoints, to and from f32.

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of e4m3 `bits` (exact; NaN for `0x7f` / `0xff`).
pub fn e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exponent, mantissa) = (i32::from((bits >> 3) & 0xf), f32::from(bits & 7));
    if bits & 0x7f == 0x7f {
        return f32::NAN;
    }
    sign * match exponent {
        0 => mantissa / 8.0 * 2f32.powi(-6),
        e => (1.0 + mantissa / 8.0) * 2f32.powi(e - 7),
    }
}

/// The nearest e4m3 to `x` (ties to even), saturating at ±448 as FP8 quantizers clamp.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    if a < MIN_NORMAL {
        // Subnormals are multiples of 2^-9 (the scaling is exact); 8 · 2^-9 is the least normal,
        // code 0x08, so rounding up into it needs no special case.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Round the f32 mantissa to 3 bits, to nearest even (a carry moves into the exponent),
    // then move the exponent from f32's bias of 127 to e4m3's 7.
    let bits = a.to_bits();
    let lsb = (bits >> 20) & 1;
    let rounded = (bits + 0x7_ffff + lsb) >> 20;
    sign | (rounded - ((127 - 7) << 3)) as u8
}

/// The scale of each `[rows, cols]` block of the row-major `values` (`k` columns): its largest
/// magnitude over 448, as the FP8 releases' quantizers set it (`weight_scale_inv`), row-major
/// `[n.div_ceil(rows), k.div_ceil(cols)]`; an all-zero block gets the least positive scale.
pub fn block_scales(values: &[f32], k: usize, block: [usize; 2]) -> Vec<f32> {
    let n = values.len() / k;
    let cols = k.div_ceil(block[1]);
    let mut scales = vec![0.0f32; n.div_ceil(block[0]) * cols];
    for (i, row) in values.chunks_exact(k).enumerate() {
        for (j, v) in row.iter().enumerate() {
            let s = &mut scales[i / block[0] * cols + j / block[1]];
            *s = s.max(v.abs() / E4M3_MAX);
        }
    }
    scales
        .iter_mut()
        .for_each(|s| *s = s.max(f32::MIN_POSITIVE));
    scales
}

/// The least normal e4m3, 2^-6.
const MIN_NORMAL: f32 = 1.0 / 64.0;

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest code by search over all of them, ties to the even code.
    fn nearest(x: f32) -> u8 {
        let a = x.abs().min(E4M3_MAX);
        let best = (0..=0x7eu8)
            .min_by(|&p, &q| {
                let (dp, dq) = ((e4m3_to_f32(p) - a).abs(), (e4m3_to_f32(q) - a).abs());
                dp.total_cmp(&dq).then((p % 2).cmp(&(q % 2)))
            })
            .unwrap();
        best | if x.is_sign_negative() { 0x80 } else { 0 }
    }

    #[test]
    fn rounding_equals_the_nearest_code_everywhere() {
        let mut x = 1e-5f32;
        while x < 500.0 {
            for v in [x, -x, x * 1.0001, x * 0.9999] {
                assert_eq!(e4m3_from_f32(v), nearest(v), "{v}");
            }
            x *= 1.003;
        }
    }

    #[test]
    fn codes_round_trip_and_ties_go_to_even() {
        for bits in 0..0x7eu8 {
            let (a, b) = (e4m3_to_f32(bits), e4m3_to_f32(bits + 1));
            assert!(a < b);
            assert_eq!(e4m3_from_f32(a), bits);
            assert_eq!(e4m3_from_f32(-a), bits | 0x80);
            assert_eq!(e4m3_from_f32((a + b) / 2.0) % 2, 0, "tie {a} / {b}");
        }
        assert_eq!(e4m3_from_f32(E4M3_MAX), 0x7e);
        assert_eq!(e4m3_from_f32(1e6), 0x7e);
        assert_eq!(e4m3_from_f32(-1e6), 0xfe);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn block_scales_are_each_blocks_largest_magnitude_over_448() {
        // 3 × 5 in blocks of 2 × 2: blocks of 2 × 2, 2 × 1, 1 × 2, 1 × 1; one all zero.
        let values = [
            1.0, -4.0, 2.0, 0.0, 8.0, //
            0.5, 3.0, -6.0, 1.0, 0.0, //
            0.0, 0.0, 0.0, 0.0, -448.0,
        ];
        let s = block_scales(&values, 5, [2, 2]);
        let want =
            [4.0, 6.0, 8.0, 0.0, 0.0, 448.0].map(|m| f32::max(m / E4M3_MAX, f32::MIN_POSITIVE));
        assert_eq!(s, want);
    }
}
