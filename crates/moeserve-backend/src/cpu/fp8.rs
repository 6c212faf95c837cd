//! FP8 block weights as DeepSeek-V3 and the Qwen3 FP8 releases ship them: each element a
//! float8 e4m3 (`float8_e4m3fn`), each `[rows, cols]` block of the matrix one f32 scale
//! (`weight_scale_inv`, despite its name the factor to multiply by): `w = e4m3 · scale`.
//!
//! The kernels keep the one-byte elements (a model loads at one byte per weight, never as a
//! bf16 copy) and widen them on the fly: e4m3's bits moved into an f16's give the value / 2^8
//! exactly, normals and subnormals alike (both formats' subnormal steps are 2^-9 and 2^-24),
//! so the widening is a sign extension, a shift, a mask and `cvtph2ps`; the 2^8 goes into the
//! blocks' scales.

/// One float8 e4m3 element (`float8_e4m3fn`), as stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct E4m3(pub u8);

impl E4m3 {
    /// The largest finite value.
    pub const MAX: f32 = moeserve_core::fp8::E4M3_MAX;

    /// The value (exact).
    pub fn to_f32(self) -> f32 {
        moeserve_core::fp8::e4m3_to_f32(self.0)
    }

    /// The nearest e4m3 (ties to even), saturating at ±448 as the quantizers clamp.
    pub fn from_f32(x: f32) -> Self {
        E4m3(moeserve_core::fp8::e4m3_from_f32(x))
    }
}

impl From<E4m3> for f32 {
    fn from(x: E4m3) -> f32 {
        x.to_f32()
    }
}

/// A matrix's block scales: block `(i, j)` covers rows `i·rows ..` and columns `j·cols ..`
/// (the last blocks of each way may be partial).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockScales {
    /// The block's rows and columns (`weight_block_size`).
    pub block: [usize; 2],
    /// The matrix's columns.
    pub k: usize,
    /// `[n.div_ceil(block[0]), k.div_ceil(block[1])]`, row-major.
    pub scales: Vec<f32>,
}

impl BlockScales {
    /// Blocks per row of blocks.
    pub fn block_cols(&self) -> usize {
        self.k.div_ceil(self.block[1])
    }

    /// The scale of element `(row, col)`.
    pub fn at(&self, row: usize, col: usize) -> f32 {
        self.scales[row / self.block[0] * self.block_cols() + col / self.block[1]]
    }

    /// Row `row` of the matrix dequantised into `out` (`k` values).
    pub fn dequantize_row(&self, values: &[E4m3], row: usize, out: &mut [f32]) {
        let row_values = &values[row * self.k..(row + 1) * self.k];
        for (j, (o, v)) in out.iter_mut().zip(row_values).enumerate() {
            *o = v.to_f32() * self.at(row, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;

    /// The f16 whose value is the e4m3 `bits`' divided by 256, as the SIMD loads make it: sign
    /// extended to 16 bits, shifted up by 7 (the sign's copies in bits 15 and 14), bit 14 cleared.
    fn f16_bits(bits: u8) -> u16 {
        ((bits as i8 as i16 as u16) << 7) & !0x4000
    }

    #[test]
    fn the_f16_bit_trick_the_kernels_use_gives_every_finite_value() {
        for bits in 0..=255u8 {
            if bits & 0x7f == 0x7f {
                continue; // NaN
            }
            let trick = f16::from_bits(f16_bits(bits)).to_f32() * 256.0;
            assert_eq!(trick, E4m3(bits).to_f32(), "{bits:#04x}");
        }
    }

    #[test]
    fn block_scales_map_elements_to_their_block() {
        let s = BlockScales {
            block: [2, 3],
            k: 7,
            scales: (0..2 * 3).map(|i| i as f32).collect(),
        };
        assert_eq!(s.block_cols(), 3);
        assert_eq!(s.at(0, 0), 0.0);
        assert_eq!(s.at(1, 6), 2.0);
        assert_eq!(s.at(3, 3), 4.0);
        let values = vec![E4m3::from_f32(2.0); 4 * 7];
        let mut row = vec![0.0; 7];
        s.dequantize_row(&values, 2, &mut row);
        assert_eq!(row, [6.0, 6.0, 6.0, 8.0, 8.0, 8.0, 10.0]);
    }
}
