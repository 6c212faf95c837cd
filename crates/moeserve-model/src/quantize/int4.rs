//! `moeserve quantize --bits 4`: GPTQ's 4-bit grid and its checkpoint format, as AutoGPTQ,
//! GPTQModel and optimum write it and transformers and vLLM read it (`checkpoint/int4.rs`
//! reads it back).
//!
//! The grid is GPTQ's asymmetric quantizer per row and group of inputs, fixed from the original
//! weights before the columns are quantized (`static_groups`): the group's range widened to
//! include 0, 15 steps, `zero = round(−min / scale)`, the scale stored in f16; a code is
//! `clamp(round(w / scale) + zero, 0, 15)` and stands for `(code − zero) · scale`. The format
//! is v1 (`checkpoint_format: "gptq"`), whose zero points are stored minus one, so a zero of 0
//! has no code (AutoGPTQ wraps it to 15, read back as 16): a group whose minimum rounds to
//! zero gets `zero = 1` and `scale = max / 14` instead, the same range one step lower.

use half::f16;

/// A matrix on the 4-bit grid: `[n, k]` codes, and per group `g` of `group` inputs and row `r`
/// a scale and a zero point (`[groups, n]`, as the checkpoint stores them).
#[derive(Clone, Debug)]
pub struct Int4Rows {
    pub n: usize,
    pub k: usize,
    pub group: usize,
    /// `[n, k]`, each in `0..16`.
    pub codes: Vec<u8>,
    /// `[groups, n]`.
    pub scales: Vec<f16>,
    /// `[groups, n]`, each in `1..16`.
    pub zeros: Vec<u8>,
}

impl Int4Rows {
    pub fn groups(&self) -> usize {
        self.k.div_ceil(self.group)
    }

    /// The grid of `w: [n, k]` in groups of `group` inputs, each group's range its values'
    /// (widened to include 0), each weight rounded to nearest.
    pub fn round_to_nearest(w: &[f32], (n, k): (usize, usize), group: usize) -> Self {
        Self::fitted(w, (n, k), group, &[1.0], None)
    }

    /// As [`Self::round_to_nearest`], but each group's range is its values' scaled by the one
    /// of `shrinks` whose rounding error, `Σ importance[p] · (w − grid(w))²` over the group's
    /// inputs `p`, is least (GPTQ's `mse` option: clipping a few outliers buys finer steps for
    /// the rest). `importance`: per input, e.g. the Hessian's diagonal (the mean square of
    /// that input over the calibration tokens); `None` weighs every input the same.
    pub fn fitted(
        w: &[f32],
        (n, k): (usize, usize),
        group: usize,
        shrinks: &[f32],
        importance: Option<&[f32]>,
    ) -> Self {
        assert!(w.len() == n * k && group > 0 && !shrinks.is_empty());
        assert!(importance.is_none_or(|i| i.len() == k));
        let groups = k.div_ceil(group);
        let mut rows = Int4Rows {
            n,
            k,
            group,
            codes: vec![0; n * k],
            scales: vec![f16::ZERO; groups * n],
            zeros: vec![0; groups * n],
        };
        for r in 0..n {
            for g in 0..groups {
                let inputs = g * group..((g + 1) * group).min(k);
                let values = &w[r * k + inputs.start..r * k + inputs.end];
                let weights = importance.map(|i| &i[inputs]);
                let (lo, hi) = values
                    .iter()
                    .fold((0.0f32, 0.0f32), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
                // GPTQ's quantizer: an all-zero group gets the range [−1, 1].
                let (lo, hi) = if lo == hi { (-1.0, 1.0) } else { (lo, hi) };
                // The first candidate unless another rounds better (so a NaN error keeps it).
                let (_, scale, zero) = shrinks
                    .iter()
                    .map(|&shrink| {
                        let (scale, zero) = group_grid(lo * shrink, hi * shrink);
                        let error = grid_error(values, weights, scale.to_f32(), zero);
                        (error, scale, zero)
                    })
                    .reduce(|best, c| if c.0 < best.0 { c } else { best })
                    .expect("shrinks is not empty");
                rows.scales[g * n + r] = scale;
                rows.zeros[g * n + r] = zero;
            }
            for p in 0..k {
                rows.codes[r * k + p] = rows.nearest(r, p, w[r * k + p]).0;
            }
        }
        rows
    }

    /// The code nearest `value` at row `r`, input `p`, and the value it stands for.
    pub fn nearest(&self, r: usize, p: usize, value: f32) -> (u8, f32) {
        let g = (p / self.group) * self.n + r;
        on_grid(value, self.scales[g].to_f32(), self.zeros[g])
    }

    /// The value of element `(r, p)`.
    pub fn dequantized(&self, r: usize, p: usize) -> f32 {
        let g = (p / self.group) * self.n + r;
        (f32::from(self.codes[r * self.k + p]) - f32::from(self.zeros[g])) * self.scales[g].to_f32()
    }

    /// The GPTQ v1 tensors: `qweight` (i32 `[k / 8, n]`, input `8i + j` of column `r` in bits
    /// `4j..` of word `[i, r]`), `qzeros` (i32 `[groups, n / 8]`, zero − 1 of output `8w + j` in
    /// bits `4j..`), `scales` (f16 `[groups, n]`) and `g_idx` (i32 `[k]`, `p / group`), as
    /// little-endian bytes. `n` and `k` are multiples of 8.
    pub fn gptq_tensors(&self) -> [(&'static str, Vec<usize>, Vec<u8>); 4] {
        let (n, k, groups) = (self.n, self.k, self.groups());
        assert!(
            n.is_multiple_of(8) && k.is_multiple_of(8),
            "GPTQ packs 8 per word"
        );
        let word = |nibble: &dyn Fn(usize) -> u8| {
            (0..8).fold(0u32, |w, j| w | u32::from(nibble(j) & 0xF) << (4 * j))
        };
        let qweight = (0..k / 8)
            .flat_map(|i| (0..n).map(move |r| (i, r)))
            .flat_map(|(i, r)| word(&|j| self.codes[r * k + 8 * i + j]).to_le_bytes())
            .collect();
        let qzeros = (0..groups)
            .flat_map(|g| (0..n / 8).map(move |w| (g, w)))
            .flat_map(|(g, w)| word(&|j| self.zeros[g * n + 8 * w + j] - 1).to_le_bytes())
            .collect();
        let scales = self.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let g_idx = (0..k)
            .flat_map(|p| ((p / self.group) as u32).to_le_bytes())
            .collect();
        [
            ("qweight", vec![k / 8, n], qweight),
            ("qzeros", vec![groups, n / 8], qzeros),
            ("scales", vec![groups, n], scales),
            ("g_idx", vec![k], g_idx),
        ]
    }
}

/// The scale (as stored, f16) and zero point of GPTQ's grid over `[lo, hi]` (`lo ≤ 0 ≤ hi`).
fn group_grid(lo: f32, hi: f32) -> (f16, u8) {
    let mut scale = (hi - lo) / 15.0;
    let mut zero = (-lo / scale).round();
    if zero < 1.0 {
        // v1 cannot store a zero point of 0 (see the module note).
        scale = hi / 14.0;
        zero = 1.0;
    }
    (f16::from_f32(scale), zero as u8)
}

/// The code nearest `value` on the grid of `scale` and `zero`, and the value it stands for.
fn on_grid(value: f32, scale: f32, zero: u8) -> (u8, f32) {
    if scale == 0.0 {
        // A group too small for f16's scales: every code stands for 0.
        return (zero, 0.0);
    }
    let zero = f32::from(zero);
    let code = ((value / scale).round() + zero).clamp(0.0, 15.0);
    (code as u8, (code - zero) * scale)
}

/// `Σ weight · (v − grid(v))²` over `values` on the grid of `scale` and `zero` (weights 1 when
/// `None`), each value rounded by [`on_grid`].
fn grid_error(values: &[f32], weights: Option<&[f32]>, scale: f32, zero: u8) -> f32 {
    let err = |v: f32| (v - on_grid(v, scale, zero).1).powi(2);
    match weights {
        Some(weights) => values.iter().zip(weights).map(|(v, w)| w * err(*v)).sum(),
        None => values.iter().map(|v| err(*v)).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_is_gptqs_and_every_value_is_within_half_a_step() {
        // Row 0 mixed signs, row 1 all positive (GPTQ's range starts at 0), row 2 all zero.
        let (n, k, group) = (3, 8, 4);
        let w = [
            -0.4, 0.1, 0.6, -0.05, 1.0, 2.0, -1.0, 0.5, //
            0.2, 0.4, 0.6, 0.8, 0.1, 0.1, 0.3, 0.2, //
            0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
        ];
        let rows = Int4Rows::round_to_nearest(&w, (n, k), group);
        // Row 0, group 0: [-0.4, 0.6] in 15 steps, zero round(0.4 / (1/15)) = 6.
        assert_eq!(rows.scales[0], f16::from_f32(1.0 / 15.0));
        assert_eq!(rows.zeros[0], 6);
        // Row 1, group 0: all positive, so the minimum is 0 and the zero point moves to 1.
        assert_eq!(
            (rows.zeros[1], rows.scales[1]),
            (1, f16::from_f32(0.8 / 14.0))
        );
        // An all-zero group gets [-1, 1], on which 0 is exact.
        assert_eq!(rows.dequantized(2, 0), 0.0);
        for r in 0..n {
            for p in 0..k {
                let step = rows.scales[(p / group) * n + r].to_f32();
                let err = (rows.dequantized(r, p) - w[r * k + p]).abs();
                assert!(
                    err <= step / 2.0 + 1e-6,
                    "({r}, {p}): off by {err}, step {step}"
                );
            }
        }
    }

    #[test]
    fn a_fitted_grid_clips_an_unimportant_outlier_and_is_never_worse_than_the_full_range() {
        // Row 0: 0, 0.1, …, 1.4 (a grid of step 0.1) and an outlier, 1.45, on an input that
        // matters little; row 1: an evenly spread group, which the full range already fits.
        let (n, k, group) = (2, 16, 16);
        let w: Vec<f32> = (0..k)
            .map(|p| if p < 15 { p as f32 / 10.0 } else { 1.45 })
            .chain((0..k).map(|p| p as f32 / 8.0 - 1.0))
            .collect();
        let mut importance = [1.0; 16];
        importance[15] = 1e-3;
        let full = Int4Rows::round_to_nearest(&w, (n, k), group);
        let fitted = Int4Rows::fitted(
            &w,
            (n, k),
            group,
            &super::super::gptq::INT4_SHRINKS,
            Some(&importance),
        );
        let error = |rows: &Int4Rows, r: usize| {
            (0..k)
                .map(|p| importance[p] * (rows.dequantized(r, p) - w[r * k + p]).powi(2))
                .sum::<f32>()
        };
        assert!(fitted.scales[0] < full.scales[0], "the outlier is clipped");
        assert_eq!(fitted.codes[15], 15, "to the top of the grid");
        assert!(error(&fitted, 0) < 0.1 * error(&full, 0));
        assert!(error(&fitted, 1) <= error(&full, 1));
    }

    #[test]
    fn a_group_whose_error_is_not_a_number_keeps_a_storable_grid() {
        let w = [0.5, f32::NAN, -0.25, 1.0];
        let importance = [1.0; 4];
        let rows = Int4Rows::fitted(
            &w,
            (1, 4),
            4,
            &super::super::gptq::INT4_SHRINKS,
            Some(&importance),
        );
        // The full range (the first candidate), whose zero point v1 can store.
        assert_eq!(
            (rows.scales[0], rows.zeros[0]),
            (f16::from_f32(1.25 / 15.0), 3)
        );
    }

    #[test]
    fn gptq_words_hold_codes_and_zero_points_as_the_format_says() {
        let (n, k, group) = (8, 16, 8);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 97) as f32 / 50.0 - 1.0)
            .collect();
        let rows = Int4Rows::round_to_nearest(&w, (n, k), group);
        let [
            (_, qs, qweight),
            (_, zs, qzeros),
            (_, ss, scales),
            (_, gs, g_idx),
        ] = rows.gptq_tensors();
        assert_eq!(
            (qs, zs, ss, gs),
            (vec![2, 8], vec![2, 1], vec![2, 8], vec![16])
        );
        let word = |bytes: &[u8], i: usize| {
            u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())
        };
        for r in 0..n {
            for p in 0..k {
                let nibble = (word(&qweight, (p / 8) * n + r) >> (4 * (p % 8))) & 0xF;
                assert_eq!(nibble as u8, rows.codes[r * k + p], "({r}, {p})");
            }
            for g in 0..2 {
                let stored = (word(&qzeros, g) >> (4 * r)) & 0xF;
                assert_eq!(stored as u8 + 1, rows.zeros[g * n + r]);
            }
        }
        assert_eq!(&scales[..2], &rows.scales[0].to_le_bytes());
        assert_eq!(word(&g_idx, 9), 1);
    }
}
