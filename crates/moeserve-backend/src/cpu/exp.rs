//! A vectorised `e^x` for `x ≤ 0` (softmax, SiLU, a logits row's normaliser), 16 lanes on
//! AVX-512 and 8 on AVX2, to about 1 ulp: Cephes `expf`, `2^n · e^r` with `|r| ≤ ln2/2` and a
//! degree-6 polynomial; below -100 the result underflows to 0. The two ISAs run the same
//! operations in the same order, so they give the same bits (a test checks it).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Arguments below this underflow to 0 (`e^-100 ≈ 3.7e-44`, a subnormal).
const FLOOR: f32 = -100.0;
/// `ln 2` in two parts, the first exact in few bits, so `x - n·ln2` loses nothing.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// The polynomial's coefficients from the highest degree down, before `r²/2 + r + 1`.
const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use super::*;

    /// `e^x` in each lane, `x ≤ 0` (see the module).
    #[target_feature(enable = "avx512f")]
    pub(in crate::cpu) fn exp(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(FLOOR));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut y = _mm512_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
        }
        let y = _mm512_fmadd_ps(
            _mm512_mul_ps(y, r),
            r,
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        _mm512_scalef_ps(y, n)
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::*;

    /// `e^x` in each lane, `x ≤ 0` (see the module); the same bits as [`super::avx512::exp`].
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::cpu) fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(FLOOR));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut y = _mm256_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
        }
        let y = _mm256_fmadd_ps(
            _mm256_mul_ps(y, r),
            r,
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        // y · 2^n without AVX-512's `scalef`: n ≥ -145 is below the normal exponents, so as
        // two normal powers of two, 2^⌊n/2⌋ then 2^(n - ⌊n/2⌋). The first product is exact
        // (y ∈ [0.7, 1.5], ⌊n/2⌋ ≥ -73), the second rounds once, as `scalef` does.
        let n = _mm256_cvtps_epi32(n);
        let half = _mm256_srai_epi32::<1>(n);
        let power = |e: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                e,
                _mm256_set1_epi32(127),
            )))
        };
        _mm256_mul_ps(
            _mm256_mul_ps(y, power(half)),
            power(_mm256_sub_epi32(n, half)),
        )
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Arguments from 0 down past the underflow, 16 per base.
    fn arguments() -> Vec<f32> {
        [0.0f32, -0.3, -1.7, -10.0, -40.0, -87.0, -95.0, -1e9]
            .iter()
            .flat_map(|base| (0..16).map(move |i| base - i as f32 * 0.37))
            .collect()
    }

    fn check(xs: &[f32], got: &[f32]) {
        for (x, g) in xs.iter().zip(got) {
            let want = (*x as f64).exp();
            let err = (*g as f64 - want).abs();
            assert!(err <= 2.5e-7 * want + 1e-37, "exp({x}) = {g}, want {want}");
        }
    }

    #[test]
    fn avx2_exp_is_accurate() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("skipped: needs AVX2 and FMA");
            return;
        }
        let xs = arguments();
        let mut got = vec![0.0f32; xs.len()];
        for (x, g) in xs.chunks_exact(8).zip(got.chunks_exact_mut(8)) {
            // SAFETY: AVX2 and FMA were detected; 8 lanes each.
            unsafe { _mm256_storeu_ps(g.as_mut_ptr(), avx2::exp(_mm256_loadu_ps(x.as_ptr()))) };
        }
        check(&xs, &got);
    }

    #[test]
    fn avx512_exp_is_accurate_and_the_avx2_bits() {
        let both = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma");
        if !both {
            eprintln!("skipped: needs AVX-512F and AVX2");
            return;
        }
        let xs = arguments();
        let mut got = vec![0.0f32; xs.len()];
        let mut narrow = vec![0.0f32; xs.len()];
        for (x, g) in xs.chunks_exact(16).zip(got.chunks_exact_mut(16)) {
            // SAFETY: AVX-512F was detected; 16 lanes each.
            unsafe { _mm512_storeu_ps(g.as_mut_ptr(), avx512::exp(_mm512_loadu_ps(x.as_ptr()))) };
        }
        for (x, g) in xs.chunks_exact(8).zip(narrow.chunks_exact_mut(8)) {
            // SAFETY: AVX2 and FMA were detected; 8 lanes each.
            unsafe { _mm256_storeu_ps(g.as_mut_ptr(), avx2::exp(_mm256_loadu_ps(x.as_ptr()))) };
        }
        check(&xs, &got);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&narrow));
    }
}
