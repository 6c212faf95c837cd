//! Element-wise and row-wise kernels: RMSNorm, SwiGLU, softmax, RoPE, residual add.
//!
//! These are memory-light next to the matmuls; they stay scalar code the compiler vectorises.

use crate::{Weight, WeightData};

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * w` for every row `r` of `x: [rows, w.len()]`.
///
/// HF: `hidden_states * torch.rsqrt(variance + self.variance_epsilon)` then `self.weight * ...`.
pub fn rms_norm(x: &[f32], w: &Weight, eps: f32, out: &mut [f32]) {
    match w.data() {
        WeightData::F32(g) => rms_norm_rows(x, g, eps, out),
        WeightData::F16(g) => rms_norm_rows(x, g, eps, out),
        WeightData::BF16(g) => rms_norm_rows(x, g, eps, out),
        WeightData::F8E4M3(..) | WeightData::Mxfp4(_) | WeightData::Int4(_) => {
            unreachable!("FP8, MXFP4 and int4 weights are matrices, never vectors")
        }
    }
}

/// The gains are widened element by element: no per-call buffer on the step's hot path.
fn rms_norm_rows<T: Copy + Into<f32>>(x: &[f32], gain: &[T], eps: f32, out: &mut [f32]) {
    let h = gain.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        norm_row(xr, gain, eps, or);
    }
}

#[inline(always)]
fn norm_row<T: Copy + Into<f32>>(xr: &[f32], gain: &[T], eps: f32, or: &mut [f32]) {
    let var = xr.iter().map(|v| v * v).sum::<f32>() / gain.len() as f32;
    let inv = 1.0 / (var + eps).sqrt();
    for ((o, v), g) in or.iter_mut().zip(xr).zip(gain) {
        *o = (*g).into() * (v * inv);
    }
}

/// [`rms_norm`] of every row of `x: [rows, w.len()]` in place (q/k norms: per head or over the
/// whole projection, by the width of `w`).
pub fn rms_norm_in_place(x: &mut [f32], w: &Weight, eps: f32) {
    fn rows<T: Copy + Into<f32>>(x: &mut [f32], gain: &[T], eps: f32) {
        for row in x.chunks_exact_mut(gain.len()) {
            let var = row.iter().map(|v| v * v).sum::<f32>() / gain.len() as f32;
            let inv = 1.0 / (var + eps).sqrt();
            row.iter_mut()
                .zip(gain)
                .for_each(|(v, g)| *v = (*g).into() * (*v * inv));
        }
    }
    match w.data() {
        WeightData::F32(g) => rows(x, g, eps),
        WeightData::F16(g) => rows(x, g, eps),
        WeightData::BF16(g) => rows(x, g, eps),
        WeightData::F8E4M3(..) | WeightData::Mxfp4(_) | WeightData::Int4(_) => {
            unreachable!("FP8, MXFP4 and int4 weights are matrices, never vectors")
        }
    }
}

/// `x[r] += b` for every row `r` of `x: [rows, b.len()]` (a linear layer's bias).
pub fn add_bias(x: &mut [f32], b: &Weight) {
    fn rows<T: Copy + Into<f32>>(x: &mut [f32], b: &[T]) {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += (*b).into());
        }
    }
    match b.data() {
        WeightData::F32(g) => rows(x, g),
        WeightData::F16(g) => rows(x, g),
        WeightData::BF16(g) => rows(x, g),
        WeightData::F8E4M3(..) | WeightData::Mxfp4(_) | WeightData::Int4(_) => {
            unreachable!("FP8, MXFP4 and int4 weights are matrices, never vectors")
        }
    }
}

/// The residual connection and the next RMSNorm in one pass over each row: `x += delta`, then
/// `out = rms_norm(x)` while the row is in cache. Equal bit for bit to [`add_assign`] followed
/// by [`rms_norm`].
pub fn add_rms_norm(x: &mut [f32], delta: &[f32], w: &Weight, eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == delta.len() && x.len() == out.len(),
        "add_rms_norm: x, delta and out differ in length"
    );
    fn rows<T: Copy + Into<f32>>(x: &mut [f32], d: &[f32], g: &[T], eps: f32, out: &mut [f32]) {
        let h = g.len();
        for ((xr, dr), or) in x
            .chunks_exact_mut(h)
            .zip(d.chunks_exact(h))
            .zip(out.chunks_exact_mut(h))
        {
            xr.iter_mut().zip(dr).for_each(|(a, b)| *a += b);
            norm_row(xr, g, eps, or);
        }
    }
    match w.data() {
        WeightData::F32(g) => rows(x, delta, g, eps, out),
        WeightData::F16(g) => rows(x, delta, g, eps, out),
        WeightData::BF16(g) => rows(x, delta, g, eps, out),
        WeightData::F8E4M3(..) | WeightData::Mxfp4(_) | WeightData::Int4(_) => {
            unreachable!("FP8, MXFP4 and int4 weights are matrices, never vectors")
        }
    }
}

/// The activation between an expert's gate and up projections and its down projection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GatedActivation {
    /// SwiGLU: `silu(gate) · up` (Mixtral and every family but GPT-OSS).
    Silu,
    /// GPT-OSS's clamped SwiGLU: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    /// `gate · σ(alpha · gate) · (up + 1)` (`swiglu_alpha`, `swiglu_limit`).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl GatedActivation {
    /// `gate[i] = act(gate[i], up[i])`.
    pub fn apply(self, gate: &mut [f32], up: &[f32]) {
        match self {
            GatedActivation::Silu => silu_mul(gate, up),
            GatedActivation::ClampedSwiglu { alpha, limit } => {
                assert_eq!(gate.len(), up.len(), "clamped SwiGLU: lengths differ");
                for (g, u) in gate.iter_mut().zip(up) {
                    let x = g.min(limit);
                    let glu = x / (1.0 + (-alpha * x).exp());
                    *g = glu * (u.clamp(-limit, limit) + 1.0);
                }
            }
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`, SwiGLU's activation (`act_fn(w1(x)) * w3(x)` in Mixtral).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "silu_mul: gate and up differ in length"
    );
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx512 {
        // SAFETY: AVX-512F is available; the slices have equal lengths.
        unsafe { silu_mul_avx512(gate, up) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx2 {
        // SAFETY: AVX2 and FMA are available; the slices have equal lengths.
        unsafe { silu_mul_avx2(gate, up) };
        return;
    }
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `gate[i] = silu(gate[i]) · up[i]` 16 lanes at a time, `silu(g) = g · σ(g)` with
/// `σ(g) = 1 / (1 + e^-|g|)` for `g ≥ 0`, `e^-|g| / (1 + e^-|g|)` below (the vectorised `exp`
/// takes arguments ≤ 0).
///
/// # Safety
/// AVX-512F is available and `gate.len() == up.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len();
    let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
    let one = _mm512_set1_ps(1.0);
    for c in (0..n).step_by(16) {
        let m = super::attention::avx512::mask(n - c);
        // SAFETY: lanes under the mask are inside both slices.
        unsafe {
            let x = _mm512_maskz_loadu_ps(m, g.add(c));
            let e = super::exp::avx512::exp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
            let denom = _mm512_add_ps(one, e);
            let positive = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_setzero_ps());
            let numer = _mm512_mask_blend_ps(positive, e, one);
            let sigmoid = _mm512_div_ps(numer, denom);
            let y = _mm512_mul_ps(
                _mm512_mul_ps(x, sigmoid),
                _mm512_maskz_loadu_ps(m, u.add(c)),
            );
            _mm512_mask_storeu_ps(g.add(c), m, y);
        }
    }
}

/// [`silu_mul_avx512`] 8 lanes at a time, the same operations (so the same bits); the last
/// part under a mask.
///
/// # Safety
/// AVX2 and FMA are available and `gate.len() == up.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len();
    let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
    for c in (0..n).step_by(8) {
        // SAFETY: 8 elements from `c`, or the lanes under the mask inside both slices.
        unsafe {
            if n - c >= 8 {
                let y = silu_mul_8(_mm256_loadu_ps(g.add(c)), _mm256_loadu_ps(u.add(c)));
                _mm256_storeu_ps(g.add(c), y);
            } else {
                let m = super::attention::avx2::mask(n - c);
                let y = silu_mul_8(
                    _mm256_maskload_ps(g.add(c), m),
                    _mm256_maskload_ps(u.add(c), m),
                );
                _mm256_maskstore_ps(g.add(c), m, y);
            }
        }
    }
}

/// `silu(x) · u` in 8 lanes ([`silu_mul_avx512`]'s steps).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn silu_mul_8(
    x: std::arch::x86_64::__m256,
    u: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let (zero, one) = (_mm256_setzero_ps(), _mm256_set1_ps(1.0));
    let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), x);
    let e = super::exp::avx2::exp(_mm256_sub_ps(zero, abs));
    let positive = _mm256_cmp_ps::<_CMP_GE_OQ>(x, zero);
    let sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
    _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), u)
}

/// `ln Σ_i e^{x_i}`, a row of logits' normaliser (`logprob = x - log_sum_exp`): the max, then
/// `e^{x - max}` summed in f64. The row must hold no NaN or +inf and a finite value. With
/// AVX-512 or AVX2 the exponentials are the vectorised f32 `exp` (`exp.rs`, about 1 ulp; the
/// sampler runs this over the whole vocabulary of every sequence every step), summed in f64
/// lanes.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx512 {
        // SAFETY: AVX-512F is available.
        let sum = unsafe { sum_exp_avx512(x, max) };
        return max + sum.ln() as f32;
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx2 {
        // SAFETY: AVX2 and FMA are available.
        let sum = unsafe { sum_exp_avx2(x, max) };
        return max + sum.ln() as f32;
    }
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    max + sum.ln() as f32
}

/// `Σ e^{x_i - max}` in f64, 16 lanes of `exp` at a time.
///
/// # Safety
/// AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_exp_avx512(x: &[f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    let n = x.len();
    let (p, max) = (x.as_ptr(), _mm512_set1_ps(max));
    let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
    for c in (0..n).step_by(16) {
        let m = super::attention::avx512::mask(n - c);
        // SAFETY: lanes under the mask are inside `x`.
        let v = unsafe { _mm512_maskz_loadu_ps(m, p.add(c)) };
        let e = super::exp::avx512::exp(_mm512_sub_ps(v, max));
        let e = _mm512_maskz_mov_ps(m, e);
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        let upper = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(upper));
    }
    _mm512_reduce_add_pd(_mm512_add_pd(lo, hi))
}

/// `Σ e^{x_i - max}` in f64, 8 lanes of `exp` at a time; the last part under a mask, its
/// other lanes cleared before the sum.
///
/// # Safety
/// AVX2 and FMA are available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_avx2(x: &[f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    let (n, p, vmax) = (x.len(), x.as_ptr(), _mm256_set1_ps(max));
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    for c in (0..n).step_by(8) {
        let m = _mm256_castsi256_ps(super::attention::avx2::mask(n - c));
        // SAFETY: lanes under the mask are inside `x`; the others read nothing.
        let v = unsafe { _mm256_maskload_ps(p.add(c), _mm256_castps_si256(m)) };
        let e = _mm256_and_ps(super::exp::avx2::exp(_mm256_sub_ps(v, vmax)), m);
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
    }
    let sum = _mm256_add_pd(lo, hi);
    let two = _mm_add_pd(_mm256_castpd256_pd128(sum), _mm256_extractf128_pd::<1>(sum));
    _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)))
}

/// Numerically stable softmax of one row, in place.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `a += b`, the residual connection.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}

/// Inverse frequencies of rotary embeddings, computed in f32 as HF's default rope init does:
/// `1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))`.
pub fn rope_inv_freq(head_dim: usize, rope_theta: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / head_dim as f32;
            1.0f32 / (rope_theta.powf(exponent as f64) as f32)
        })
        .collect()
}

/// Rotates every head of `x: [num_heads, head_dim]` at `position` (HF's `rotate_half` layout:
/// the first and second halves of the rotated part form the pairs). The rotated part is the
/// first `2 · angles.len()` elements of a head: all of it, or its leading part under a
/// `partial_rotary_factor` (GLM-4.5), the rest passing through.
pub fn apply_rope(x: &mut [f32], head_dim: usize, angles: &RopeAngles) {
    let half = angles.cos_sin.len();
    debug_assert!(2 * half <= head_dim);
    for head in x.chunks_exact_mut(head_dim) {
        for (i, (cos, sin)) in angles.cos_sin.iter().enumerate() {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

/// Rotates every head of `x: [num_heads, head_dim]` as [`apply_rope`] does, on interleaved
/// pairs `(x0, x1), (x2, x3), …` instead (DeepSeek's layout: V2's complex product, V3's
/// `rope_interleave`); each pair in place.
pub fn apply_rope_interleaved(x: &mut [f32], head_dim: usize, angles: &RopeAngles) {
    debug_assert!(2 * angles.cos_sin.len() <= head_dim);
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, (cos, sin)) in head.chunks_exact_mut(2).zip(&angles.cos_sin) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos - b * sin;
            pair[1] = b * cos + a * sin;
        }
    }
}

/// `(cos, sin)` of every rotary frequency at one position, computed once and applied to all
/// query and key heads of a token (the sines and cosines, not the rotation, are the cost).
#[derive(Clone, Debug, Default)]
pub struct RopeAngles {
    cos_sin: Vec<(f32, f32)>,
}

impl RopeAngles {
    /// The angles `position · inv_freq[i]`, rounded to f32 as HF does, then sin/cos in f64.
    pub fn set(&mut self, position: usize, inv_freq: &[f32]) {
        self.set_scaled(position, inv_freq, 1.0);
    }

    /// [`RopeAngles::set`] with the cosines and sines multiplied by `attention_scaling` (HF's
    /// `cos = emb.cos() * self.attention_scaling`: YaRN's mscale; 1 for plain RoPE).
    pub fn set_scaled(&mut self, position: usize, inv_freq: &[f32], attention_scaling: f32) {
        self.cos_sin.clear();
        self.cos_sin.extend(inv_freq.iter().map(|f| {
            let angle = (position as f32 * f) as f64;
            let (cos, sin) = (angle.cos() as f32, angle.sin() as f32);
            match attention_scaling == 1.0 {
                true => (cos, sin),
                false => (cos * attention_scaling, sin * attention_scaling),
            }
        }));
    }

    pub fn at(position: usize, inv_freq: &[f32]) -> Self {
        let mut a = RopeAngles::default();
        a.set(position, inv_freq);
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_sum_exp_matches_the_f64_definition() {
        let mut state = 7u64;
        for n in [1, 15, 16, 17, 1000, 49_152] {
            let mut row: Vec<f32> = (0..n)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    ((state >> 40) % 4001) as f32 * 0.01 - 20.0
                })
                .collect();
            if n > 1 {
                row[0] = 35.0;
                row[n / 2] = f32::NEG_INFINITY;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
            let want = max as f64 + sum.ln();
            let got = log_sum_exp(&row);
            assert!(
                (f64::from(got) - want).abs() < 4e-6,
                "n {n}: {got} vs {want}"
            );
        }
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY, 2.0]), 2.0);
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut x = vec![1.0, 3.0, 2.0, -1e9];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[2] && x[2] > x[0] && x[3] == 0.0);
    }

    #[test]
    fn add_rms_norm_equals_add_then_norm() {
        let w = Weight::from_f32(vec![4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let x: Vec<f32> = (0..12).map(|i| i as f32 * 0.3 - 1.1).collect();
        let d: Vec<f32> = (0..12).map(|i| (i * 7 % 5) as f32 * 0.01).collect();
        let (mut fused_x, mut fused) = (x.clone(), vec![0.0; 12]);
        add_rms_norm(&mut fused_x, &d, &w, 1e-6, &mut fused);
        let (mut two_x, mut two) = (x, vec![0.0; 12]);
        add_assign(&mut two_x, &d);
        rms_norm(&two_x, &w, 1e-6, &mut two);
        assert_eq!((fused_x, fused), (two_x, two));
    }

    #[test]
    fn silu_mul_matches_the_definition_on_every_path() {
        for n in [1, 15, 16, 17, 100] {
            let gate: Vec<f32> = (0..n).map(|i| (i as f32 - 50.0) * 0.37).collect();
            let up: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 0.01).collect();
            let mut got = gate.clone();
            silu_mul(&mut got, &up);
            for ((g, u), y) in gate.iter().zip(&up).zip(&got) {
                let (g, u) = (*g as f64, *u as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!(
                    (*y as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "silu({g}) * {u}: {y} vs {want}"
                );
            }
        }
        let mut extreme = vec![-1e4, 1e4, -100.0, 100.0, 0.0];
        silu_mul(&mut extreme, &[1.0; 5]);
        assert!(extreme.iter().all(|v| v.is_finite()), "{extreme:?}");
        assert!(
            extreme[0].abs() < 1e-30 && extreme[2].abs() < 1e-30,
            "{extreme:?}"
        );
        assert_eq!(extreme[1..2], [1e4]);
        assert_eq!(extreme[3..], [100.0, 0.0]);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let inv = rope_inv_freq(8, 10000.0);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.7).collect();
        let mut x = orig.clone();
        apply_rope(&mut x, 8, &RopeAngles::at(0, &inv));
        assert_eq!(x, orig);
        apply_rope(&mut x, 8, &RopeAngles::at(37, &inv));
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&orig)).abs() < 1e-4);
    }

    /// With a `partial_rotary_factor`, the rotated part is a head's leading `rotary_dim`
    /// elements, paired as HF pairs them within that part; the rest passes unchanged.
    #[test]
    fn partial_rope_rotates_the_leading_part_of_each_head_only() {
        let (head_dim, rotary) = (8, 4);
        let inv = rope_inv_freq(rotary, 10000.0);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.7).collect();
        let mut x = orig.clone();
        let angles = RopeAngles::at(5, &inv);
        apply_rope(&mut x, head_dim, &angles);
        for (head, (got, was)) in x.chunks(head_dim).zip(orig.chunks(head_dim)).enumerate() {
            assert_eq!(
                got[rotary..],
                was[rotary..],
                "head {head}'s pass-through part"
            );
            for i in 0..rotary / 2 {
                let a = (5.0f32 * inv[i]) as f64;
                let (c, s) = (a.cos() as f32, a.sin() as f32);
                let (x1, x2) = (was[i], was[i + rotary / 2]);
                assert_eq!(got[i], x1 * c - x2 * s);
                assert_eq!(got[i + rotary / 2], x2 * c + x1 * s);
            }
        }
    }

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let w = Weight::from_f32(vec![4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let mut out = vec![0.0; 4];
        rms_norm(&[2.0; 4], &w, 0.0, &mut out);
        assert_eq!(out, vec![1.0, 2.0, 3.0, 4.0]);
    }
}
