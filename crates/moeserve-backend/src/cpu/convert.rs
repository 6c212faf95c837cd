//! Widening of stored element types to f32 (FP8, MXFP4 and int4 weights: dequantised).

use crate::WeightData;

/// Writes `src` widened to f32 into `dst` (same length).
pub fn widen_into(src: WeightData<'_>, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_into: length mismatch");
    match src {
        WeightData::F32(v) => dst.copy_from_slice(v),
        WeightData::F16(v) => dst.iter_mut().zip(v).for_each(|(d, s)| *d = s.to_f32()),
        WeightData::BF16(v) => dst.iter_mut().zip(v).for_each(|(d, s)| *d = s.to_f32()),
        WeightData::F8E4M3(v, scales) => {
            for (row, out) in dst.chunks_exact_mut(scales.k).enumerate() {
                scales.dequantize_row(v, row, out);
            }
        }
        WeightData::Mxfp4(p) => {
            for (row, out) in dst.chunks_exact_mut(p.shape()[1]).enumerate() {
                p.row_into(row, out);
            }
        }
        WeightData::Int4(p) => {
            for (row, out) in dst.chunks_exact_mut(p.shape()[1]).enumerate() {
                p.row_into(row, out);
            }
        }
    }
}

/// Widens row `row` of a row-major `[rows, cols]` tensor into `dst` (length `cols`).
pub fn widen_row(src: WeightData<'_>, row: usize, dst: &mut [f32]) {
    let cols = dst.len();
    let range = row * cols..(row + 1) * cols;
    match src {
        WeightData::F32(v) => widen_into(WeightData::F32(&v[range]), dst),
        WeightData::F16(v) => widen_into(WeightData::F16(&v[range]), dst),
        WeightData::BF16(v) => widen_into(WeightData::BF16(&v[range]), dst),
        WeightData::F8E4M3(v, scales) => scales.dequantize_row(v, row, dst),
        WeightData::Mxfp4(p) => p.row_into(row, dst),
        WeightData::Int4(p) => p.row_into(row, dst),
    }
}
