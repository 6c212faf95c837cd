//! GPTQ (Frantar et al. 2022) onto the int8 grid of `--quantization int8` or GPTQ's own 4-bit
//! grid ([`super::int4`]), in act-order with static groups: every group's scale and offset are
//! fixed beforehand from the original weights (int8: exactly what round-to-nearest stores;
//! int4: the range that rounds them best, [`INT4_SHRINKS`]), then the columns are quantized in
//! order of decreasing Hessian diagonal, each column's rounding error spread over the columns
//! not yet quantized through the inverse Hessian's Cholesky factor. Only the integers differ
//! from round-to-nearest on the same grid, so the kernels and the stored format are unchanged.
//!
//! ```text
//! H = Σ x xᵀ + λ·mean(diag H)·I          x: the matrix's calibration inputs, λ = damp
//! U = chol(H⁻¹) (upper)                  columns permuted by decreasing diag H
//! for column i:  q_i = grid(w_i);  e = (w_i − q_i) / U_ii;  w_j −= e · U_ij  (j > i)
//! ```
//! As the reference implementation, the updates are applied lazily in blocks of `block` columns:
//! inside a block column by column, to the rest of the matrix as one GEMM per block.

use moeserve_backend::cpu::quant::{GROUP, Int8Rows, quantize_rows_int8};
use moeserve_backend::{Weight, WeightData, cpu};

use super::int4::Int4Rows;

/// GPTQ's knobs (the reference implementation's defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptqOptions {
    /// Added to the Hessian's diagonal, as a fraction of its mean.
    pub damp: f32,
    /// Columns per lazy update.
    pub block: usize,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions {
            damp: 0.01,
            block: 128,
        }
    }
}

/// Why GPTQ fell back to round-to-nearest for a matrix.
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    /// The damped Hessian was not positive definite in f32 at this column.
    NotPositiveDefinite { column: usize },
}

/// Quantizes `w: [n, k]` (row-major) given `h: [k, k] = Σ x xᵀ` over its calibration inputs.
/// Columns no calibration input reached (zero diagonal) are rounded to nearest and pass no
/// error on. Returns round-to-nearest and the reason when the Hessian cannot be factored.
pub fn gptq_int8(
    w: &[f32],
    n: usize,
    k: usize,
    h: Vec<f32>,
    opts: GptqOptions,
) -> (Int8Rows, Option<Fallback>) {
    let mut rows = quantize_rows_int8(WeightData::F32(w), n, k);
    let groups = k.div_ceil(GROUP);
    let fallback = gptq_columns(w, (n, k), h, opts, |r, column, value| {
        let g = r * groups + column / GROUP;
        let (s, o) = (rows.scales[g], rows.offsets[g]);
        let q = if s == 0.0 {
            0.0
        } else {
            ((value - o) / s).round().clamp(-128.0, 127.0)
        };
        rows.q[r * k + column] = q as i8;
        q * s + o
    });
    (rows, fallback)
}

/// The ranges [`gptq_int4`] tries for each group: its values' range scaled by 1, 0.99, …, 0.71
/// (AutoGPTQ's `mse` search steps by 0.01 too, down to 0.2; the first 30 steps bound the cost
/// at 30 roundings per weight).
pub const INT4_SHRINKS: [f32; 30] = {
    let mut s = [0.0; 30];
    let mut i = 0;
    while i < 30 {
        s[i] = 1.0 - i as f32 / 100.0;
        i += 1;
    }
    s
};

/// [`gptq_int8`] onto GPTQ's 4-bit grid with static groups of `group` inputs ([`Int4Rows`]),
/// each group's range the one of [`INT4_SHRINKS`] that rounds the original weights with the
/// least error weighted by the Hessian's diagonal (each input's mean square).
pub fn gptq_int4(
    w: &[f32],
    (n, k): (usize, usize),
    group: usize,
    h: Vec<f32>,
    opts: GptqOptions,
) -> (Int4Rows, Option<Fallback>) {
    let mut rows = Int4Rows::fitted(w, (n, k), group, &INT4_SHRINKS, Some(&diagonal(&h, k)));
    let fallback = gptq_columns(w, (n, k), h, opts, |r, column, value| {
        let (code, dequantized) = rows.nearest(r, column, value);
        rows.codes[r * k + column] = code;
        dequantized
    });
    (rows, fallback)
}

/// The diagonal of `h: [k, k]`: each input's sum of squares over the calibration tokens.
fn diagonal(h: &[f32], k: usize) -> Vec<f32> {
    (0..k).map(|i| h[i * k + i]).collect()
}

/// GPTQ's column loop over `w: [n, k]`: `round(r, column, value)` puts `value` (the column's
/// weight after the error of the columns before it) on the grid, records the code and returns
/// the value the code stands for. `None`: done; else why the matrix was left to the grid's
/// round-to-nearest (which the caller made before).
fn gptq_columns(
    w: &[f32],
    (n, k): (usize, usize),
    mut h: Vec<f32>,
    opts: GptqOptions,
    mut round: impl FnMut(usize, usize, f32) -> f32,
) -> Option<Fallback> {
    assert_eq!((w.len(), h.len()), (n * k, k * k), "gptq: shapes");
    let mut mean_diag = 0.0f64;
    for i in 0..k {
        if h[i * k + i] <= 0.0 {
            // A dead input: its row and column are zero (H is a sum of outer products).
            h[i * k + i] = 1.0;
        }
        mean_diag += f64::from(h[i * k + i]);
    }
    let damp = opts.damp * (mean_diag / k as f64) as f32;
    for i in 0..k {
        h[i * k + i] += damp;
    }
    // Act-order: the columns with the largest inputs first, while most columns can still absorb
    // their error.
    let mut perm: Vec<usize> = (0..k).collect();
    perm.sort_by(|a, b| h[b * k + b].total_cmp(&h[a * k + a]));
    let u = match inverse_cholesky_upper(&h, k, &perm) {
        Ok(u) => u,
        Err(column) => return Some(Fallback::NotPositiveDefinite { column }),
    };
    // `wt[i]`: permuted column i, contiguous over the rows.
    let mut wt = vec![0.0f32; k * n];
    for (i, &c) in perm.iter().enumerate() {
        for r in 0..n {
            wt[i * n + r] = w[r * k + c];
        }
    }
    let mut err = vec![0.0f32; opts.block * n];
    for i1 in (0..k).step_by(opts.block) {
        let i2 = (i1 + opts.block).min(k);
        for i in i1..i2 {
            let column = perm[i];
            let (done, rest) = wt.split_at_mut((i + 1) * n);
            let wi = &done[i * n..];
            let e = &mut err[(i - i1) * n..(i - i1 + 1) * n];
            for r in 0..n {
                e[r] = (wi[r] - round(r, column, wi[r])) / u[i * k + i];
            }
            for j in i + 1..i2 {
                let wj = &mut rest[(j - i - 1) * n..(j - i) * n];
                lanes::axpy(-u[i * k + j], e, wj);
            }
        }
        if i2 < k {
            lazy_update(
                &mut wt[i2 * n..],
                &err[..(i2 - i1) * n],
                &u,
                (k, n),
                (i1, i2),
            );
        }
    }
    None
}

/// `wt[j − i2] −= Σ_b U[i1 + b][j] · err[b]` for every column `j ≥ i2`, as one GEMM.
fn lazy_update(
    wt: &mut [f32],
    err: &[f32],
    u: &[f32],
    (k, n): (usize, usize),
    (i1, i2): (usize, usize),
) {
    let (b, m) = (i2 - i1, k - i2);
    let mut x = vec![0.0f32; m * b];
    for (j, row) in x.chunks_exact_mut(b).enumerate() {
        for (bb, v) in row.iter_mut().enumerate() {
            *v = u[(i1 + bb) * k + i2 + j];
        }
    }
    let e = transposed(err, b, n);
    let mut out = vec![0.0f32; m * n];
    cpu::matmul_wt(&x, m, &f32_matrix(vec![n, b], &e), &mut out);
    for (w, d) in wt.iter_mut().zip(&out) {
        *w -= d;
    }
}

/// `x: [rows, cols]` (row-major) transposed to `[cols, rows]`.
pub(crate) fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    for (r, row) in x.chunks_exact(cols).enumerate() {
        for (c, v) in row.iter().enumerate() {
            out[c * rows + r] = *v;
        }
    }
    out
}

/// An f32 operand for `cpu::matmul_wt` that `--quantization` leaves alone.
pub(crate) fn f32_matrix(shape: Vec<usize>, values: &[f32]) -> Weight {
    Weight::from_f32(shape, values)
        .expect("an f32 buffer of its own shape")
        .exact()
}

/// The upper Cholesky factor `U` of `(P H Pᵀ)⁻¹` (`P` the permutation `perm`, `(P H Pᵀ)⁻¹ = UᵀU`),
/// `[k, k]` row-major; `Err(column)` where the factorization breaks down.
///
/// With `J` the reversal, `J (P H Pᵀ) J = L Lᵀ` gives `P H Pᵀ = R Rᵀ` with `R = J L J` upper, so
/// `(P H Pᵀ)⁻¹ = (R⁻¹)ᵀ R⁻¹` and `U = R⁻¹ = J L⁻¹ J`: one Cholesky and one triangular inverse.
fn inverse_cholesky_upper(h: &[f32], k: usize, perm: &[usize]) -> Result<Vec<f32>, usize> {
    // a = J P H Pᵀ J, lower triangle only.
    let mut a = vec![0.0f32; k * k];
    for i in 0..k {
        for j in 0..=i {
            a[i * k + j] = h[perm[k - 1 - i] * k + perm[k - 1 - j]];
        }
    }
    cholesky_lower(&mut a, k).map_err(|i| k - 1 - i)?;
    let l_inv = lower_inverse(&a, k);
    let mut u = vec![0.0f32; k * k];
    for i in 0..k {
        for j in i..k {
            u[i * k + j] = l_inv[(k - 1 - i) * k + (k - 1 - j)];
        }
    }
    Ok(u)
}

/// In-place Cholesky of the lower triangle of `a: [k, k]` (row by row); `Err(i)` at the first
/// non-positive pivot.
fn cholesky_lower(a: &mut [f32], k: usize) -> Result<(), usize> {
    for i in 0..k {
        let (above, row) = a.split_at_mut(i * k);
        let row = &mut row[..k];
        for j in 0..i {
            let lj = &above[j * k..j * k + j];
            row[j] = (row[j] - lanes::dot(&row[..j], lj)) / above[j * k + j];
        }
        let d = row[i] - lanes::dot(&row[..i], &row[..i]);
        if d <= 0.0 || !d.is_finite() {
            return Err(i);
        }
        row[i] = d.sqrt();
        row[i + 1..].fill(0.0);
    }
    Ok(())
}

/// `L⁻¹` of a lower-triangular `l: [k, k]` with a positive diagonal, row by row:
/// `X_i = (e_i − Σ_{m<i} L_im X_m) / L_ii`, each row of `X` zero beyond its diagonal.
fn lower_inverse(l: &[f32], k: usize) -> Vec<f32> {
    let mut x = vec![0.0f32; k * k];
    for i in 0..k {
        let (above, row) = x.split_at_mut(i * k);
        let row = &mut row[..k];
        row[i] = 1.0;
        for m in 0..i {
            let c = l[i * k + m];
            if c != 0.0 {
                lanes::axpy(-c, &above[m * k..m * k + m + 1], &mut row[..m + 1]);
            }
        }
        let d = l[i * k + i];
        row[..=i].iter_mut().for_each(|v| *v /= d);
    }
    x
}

/// Dot products and `y += a·x` in 16 lanes, compiled for AVX-512 where the CPU has it; the same
/// summation order either way, so results do not depend on the machine.
pub(crate) mod lanes {
    const LANES: usize = 16;

    #[inline(always)]
    fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0.0f32; LANES];
        let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        let tail: f32 = ca
            .remainder()
            .iter()
            .zip(cb.remainder())
            .map(|(x, y)| x * y)
            .sum();
        for (x, y) in ca.zip(cb) {
            for l in 0..LANES {
                acc[l] += x[l] * y[l];
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    #[inline(always)]
    fn axpy_lanes(a: f32, x: &[f32], y: &mut [f32]) {
        for (yv, xv) in y.iter_mut().zip(x) {
            *yv += a * xv;
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        dot_lanes(a, b)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn axpy_avx512(a: f32, x: &[f32], y: &mut [f32]) {
        axpy_lanes(a, x, y)
    }

    fn has_avx512() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `Σ a_i b_i` over the shorter of the two.
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if has_avx512() {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { dot_avx512(a, b) };
        }
        dot_lanes(a, b)
    }

    /// `y += a · x` over the shorter of the two.
    pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if has_avx512() {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { axpy_avx512(a, x, y) };
        }
        axpy_lanes(a, x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect()
    }

    /// `Σ_t (x_t · (w_r − q_r))²` summed over rows: the output error GPTQ minimizes.
    fn output_error(w: &[f32], rows: &Int8Rows, x: &[f32], n: usize, k: usize) -> f64 {
        let groups = k.div_ceil(GROUP);
        output_error_of(w, x, (n, k), |r, p| {
            let g = r * groups + p / GROUP;
            f32::from(rows.q[r * k + p]) * rows.scales[g] + rows.offsets[g]
        })
    }

    /// [`output_error`] of any quantized matrix, `deq(r, p)` its elements.
    fn output_error_of(
        w: &[f32],
        x: &[f32],
        (n, k): (usize, usize),
        deq: impl Fn(usize, usize) -> f32,
    ) -> f64 {
        let mut total = 0.0f64;
        for xt in x.chunks_exact(k) {
            for r in 0..n {
                let mut d = 0.0f64;
                for p in 0..k {
                    d += f64::from(xt[p]) * f64::from(w[r * k + p] - deq(r, p));
                }
                total += d * d;
            }
        }
        total
    }

    fn hessian(x: &[f32], k: usize) -> Vec<f32> {
        let mut h = vec![0.0f32; k * k];
        for xt in x.chunks_exact(k) {
            for i in 0..k {
                for j in 0..k {
                    h[i * k + j] += xt[i] * xt[j];
                }
            }
        }
        h
    }

    #[test]
    fn inverse_cholesky_factor_multiplies_back_to_the_inverse() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let k = 37;
        let x = random(&mut rng, 80 * k);
        let mut h = hessian(&x, k);
        (0..k).for_each(|i| h[i * k + i] += 0.1);
        let perm: Vec<usize> = (0..k).rev().collect();
        let u = inverse_cholesky_upper(&h, k, &perm).unwrap();
        // (UᵀU) (P H Pᵀ) = I.
        for i in 0..k {
            for j in 0..k {
                let mut v = 0.0f64;
                for m in 0..k {
                    let mut utu = 0.0f64;
                    for l in 0..k {
                        utu += f64::from(u[l * k + i]) * f64::from(u[l * k + m]);
                    }
                    v += utu * f64::from(h[perm[m] * k + perm[j]]);
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-3, "({i}, {j}): {v}");
            }
            assert!(u[i * k + i] > 0.0);
            assert!((0..i).all(|j| u[i * k + j] == 0.0), "U is upper triangular");
        }
    }

    #[test]
    fn identity_hessian_gives_round_to_nearest() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let (n, k) = (5, 2 * GROUP + 7);
        let w = random(&mut rng, n * k);
        let h: Vec<f32> = (0..k * k)
            .map(|i| if i % (k + 1) == 0 { 1.0 } else { 0.0 })
            .collect();
        let (rows, fallback) = gptq_int8(&w, n, k, h, GptqOptions::default());
        let rtn = quantize_rows_int8(WeightData::F32(&w), n, k);
        assert_eq!(fallback, None);
        assert_eq!((rows.scales, rows.offsets), (rtn.scales, rtn.offsets));
        assert_eq!(rows.q, rtn.q);
    }

    #[test]
    fn correlated_inputs_get_less_output_error_than_round_to_nearest() {
        // Inputs with a few strong shared directions, as a layer's activations have: GPTQ moves
        // each column's rounding error to columns that can cancel it.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (n, k, t) = (24, 2 * GROUP, 600);
        let w = random(&mut rng, n * k);
        let basis = random(&mut rng, 4 * k);
        let x: Vec<f32> = (0..t)
            .flat_map(|_| {
                let c = random(&mut rng, 4);
                let noise = random(&mut rng, k);
                (0..k)
                    .map(|p| (0..4).map(|b| c[b] * basis[b * k + p]).sum::<f32>() + 0.05 * noise[p])
                    .collect::<Vec<_>>()
            })
            .collect();
        let (rows, fallback) = gptq_int8(&w, n, k, hessian(&x, k), GptqOptions::default());
        assert_eq!(fallback, None);
        let rtn = quantize_rows_int8(WeightData::F32(&w), n, k);
        let (gptq_err, rtn_err) = (
            output_error(&w, &rows, &x, n, k),
            output_error(&w, &rtn, &x, n, k),
        );
        assert!(
            gptq_err < 0.5 * rtn_err,
            "GPTQ {gptq_err:.3e} vs round-to-nearest {rtn_err:.3e}"
        );
        assert_eq!(
            rows.scales, rtn.scales,
            "static groups: the grids are RTN's"
        );
    }

    /// Inputs with a few strong shared directions, as a layer's activations have.
    fn correlated_inputs(rng: &mut ChaCha8Rng, k: usize, t: usize) -> Vec<f32> {
        let basis = random(rng, 4 * k);
        (0..t)
            .flat_map(|_| {
                let c = random(rng, 4);
                let noise = random(rng, k);
                (0..k)
                    .map(|p| (0..4).map(|b| c[b] * basis[b * k + p]).sum::<f32>() + 0.05 * noise[p])
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn the_4_bit_grid_gets_less_output_error_than_its_round_to_nearest_too() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let (n, k, group) = (24, 128, 32);
        let w = random(&mut rng, n * k);
        let x = correlated_inputs(&mut rng, k, 600);
        let h = hessian(&x, k);
        // Round-to-nearest on the same grid (each group's range fitted as `gptq_int4` fits it).
        let rtn = Int4Rows::fitted(&w, (n, k), group, &INT4_SHRINKS, Some(&diagonal(&h, k)));
        let (rows, fallback) = gptq_int4(&w, (n, k), group, h, GptqOptions::default());
        assert_eq!(fallback, None);
        let (gptq_err, rtn_err) = (
            output_error_of(&w, &x, (n, k), |r, p| rows.dequantized(r, p)),
            output_error_of(&w, &x, (n, k), |r, p| rtn.dequantized(r, p)),
        );
        assert!(
            gptq_err < 0.5 * rtn_err,
            "GPTQ {gptq_err:.3e} vs round-to-nearest {rtn_err:.3e}"
        );
        assert_eq!(
            (&rows.scales, &rows.zeros),
            (&rtn.scales, &rtn.zeros),
            "static groups"
        );
        assert!(rows.codes.iter().all(|&c| c < 16));
    }

    #[test]
    fn dead_inputs_are_rounded_to_nearest() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let (n, k) = (3, GROUP);
        let w = random(&mut rng, n * k);
        // Only input 0 is ever non-zero.
        let mut h = vec![0.0f32; k * k];
        h[0] = 4.0;
        let (rows, fallback) = gptq_int8(&w, n, k, h, GptqOptions::default());
        let rtn = quantize_rows_int8(WeightData::F32(&w), n, k);
        assert_eq!(fallback, None);
        for r in 0..n {
            assert_eq!(
                &rows.q[r * k + 1..(r + 1) * k],
                &rtn.q[r * k + 1..(r + 1) * k]
            );
        }
    }

    #[test]
    fn lanes_match_plain_sums() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (a, b) = (random(&mut rng, 37), random(&mut rng, 37));
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((lanes::dot(&a, &b) - plain).abs() < 1e-5);
        let mut y = b.clone();
        lanes::axpy(2.0, &a, &mut y);
        assert!(
            y.iter()
                .zip(a.iter().zip(&b))
                .all(|(v, (x, z))| *v == z + 2.0 * x)
        );
    }
}
