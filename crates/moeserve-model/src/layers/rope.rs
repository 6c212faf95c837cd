//! Rotary embeddings' frequencies: plain RoPE, or YaRN (`rope_type: "yarn"`) as transformers'
//! `_compute_yarn_parameters` computes them, for the rotated part of a head (`rotary_dim`).
//!
//! YaRN blends each frequency between its plain value (extrapolation, fast-rotating dimensions)
//! and its value divided by `factor` (interpolation, slow ones) by a linear ramp between the
//! dimensions that make `beta_fast` and `beta_slow` rotations over the original context, and
//! multiplies the cosines and sines by the attention factor (`0.1·ln(factor) + 1`, or
//! `mscale` / `mscale_all_dim`'s ratio of those when both are given).

use moeserve_backend::cpu;

/// `rope_type` and its parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type: "default"`).
    None,
    Yarn(Yarn),
}

/// YaRN's parameters as `rope_parameters` (or the older `rope_scaling`) gives them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// The cos/sin scaling when the config sets it; else computed from `factor` and `mscale` /
    /// `mscale_all_dim`.
    pub attention_factor: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// Round the ramp's bounds outwards (`truncate`, default true).
    pub truncate: bool,
}

impl Yarn {
    /// The factor the cosines and sines are multiplied by.
    pub fn attention_factor(&self) -> f64 {
        let get_mscale = |scale: f64, mscale: f64| match scale <= 1.0 {
            true => 1.0,
            false => 0.1 * mscale * scale.ln() + 1.0,
        };
        if let Some(a) = self.attention_factor {
            return a;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                get_mscale(self.factor, m) / get_mscale(self.factor, all)
            }
            _ => get_mscale(self.factor, 1.0),
        }
    }
}

/// The inverse frequencies of the rotated part of a head and the cos/sin scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFrequencies {
    /// `[rotary_dim / 2]`
    pub inv_freq: Vec<f32>,
    pub attention_scaling: f32,
}

impl RopeFrequencies {
    pub fn new(rotary_dim: usize, rope_theta: f64, scaling: RopeScaling) -> Self {
        let RopeScaling::Yarn(yarn) = scaling else {
            return RopeFrequencies {
                inv_freq: cpu::rope_inv_freq(rotary_dim, rope_theta),
                attention_scaling: 1.0,
            };
        };
        let dim = rotary_dim as f64;
        // The dimension that makes `rotations` turns over the original context.
        let correction_dim = |rotations: f64| {
            let max = yarn.original_max_position_embeddings as f64;
            dim * (max / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * rope_theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(yarn.beta_fast),
            correction_dim(yarn.beta_slow),
        );
        if yarn.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001; // as transformers, against a zero-width ramp
        }
        let (low, high, factor) = (low as f32, high as f32, yarn.factor as f32);
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| {
                // `base^(2i/dim)` as `cpu::rope_inv_freq` computes it; its inverse is the plain
                // frequency, its inverse times `1 / factor` the interpolated one.
                let exponent = (2 * i) as f32 / rotary_dim as f32;
                let pos_freq = rope_theta.powf(exponent as f64) as f32;
                let (extrapolation, interpolation) = (1.0 / pos_freq, 1.0 / (factor * pos_freq));
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation_factor = 1.0 - ramp;
                interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
            })
            .collect();
        RopeFrequencies {
            inv_freq,
            attention_scaling: yarn.attention_factor() as f32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64) -> Yarn {
        Yarn {
            factor,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        }
    }

    #[test]
    fn yarn_keeps_fast_dimensions_and_divides_slow_ones_by_the_factor() {
        let plain = RopeFrequencies::new(128, 1e6, RopeScaling::None);
        assert_eq!(plain.attention_scaling, 1.0);
        let scaled = RopeFrequencies::new(128, 1e6, RopeScaling::Yarn(yarn(4.0)));
        assert_eq!(
            scaled.inv_freq[0], plain.inv_freq[0],
            "the fastest is extrapolated"
        );
        let last = plain.inv_freq.len() - 1;
        let ratio = plain.inv_freq[last] / scaled.inv_freq[last];
        assert!(
            (ratio - 4.0).abs() < 1e-5,
            "the slowest is interpolated: {ratio}"
        );
        assert!((scaled.attention_scaling - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-7);
    }

    #[test]
    fn mscale_and_mscale_all_dim_set_the_attention_factor() {
        let both = Yarn {
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            ..yarn(40.0)
        };
        assert_eq!(both.attention_factor(), 1.0);
        let given = Yarn {
            attention_factor: Some(0.7),
            ..yarn(40.0)
        };
        assert_eq!(given.attention_factor(), 0.7);
        assert_eq!(yarn(1.0).attention_factor(), 1.0);
    }
}
