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
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // The magnitudes of codes 0..=0x7e increase with the code: take the nearest.
    let (mut lo, mut hi) = (0u8, 0x7e);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (below, above) = (e4m3_to_f32(lo), e4m3_to_f32(hi));
    let nearer_below = a - below < above - a || (a - below == above - a && lo % 2 == 0);
    let code = match (a >= above, nearer_below) {
        (true, _) => hi,
        (false, true) => lo,
        (false, false) => hi,
    };
    code | sign
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
