//! Scalar reference kernels: the definition every optimised variant is tested against.

/// `out[i, j] = sum_k x[i, k] * w[j, k]` for row-major `x: [m, k]`, `w: [n, k]` given as f32.
pub fn matmul_wt(x: &[f32], m: usize, w: &[f32], n: usize, out: &mut [f32]) {
    let k = x.len() / m;
    for i in 0..m {
        for j in 0..n {
            let (wr, xr) = (&w[j * k..(j + 1) * k], &x[i * k..(i + 1) * k]);
            out[i * n + j] = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
        }
    }
}

/// Deterministic test values in [-0.5, 0.5), different for each `seed`.
#[cfg(test)]
pub(crate) fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503));
            ((h >> 8) as f32 / (1u32 << 24) as f32) - 0.5
        })
        .collect()
}

/// A test weight of `dtype` holding `values` (rounded to that type).
#[cfg(test)]
pub(crate) fn weight_of(
    dtype: moeserve_core::DType,
    shape: Vec<usize>,
    values: &[f32],
) -> crate::Weight {
    use half::{bf16, f16};
    use moeserve_core::DType;
    let bytes: Vec<u8> = match dtype {
        DType::F32 => bytemuck::cast_slice(values).to_vec(),
        DType::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::F8E4M3 => return fp8_weight_of(shape, [128, 128], values),
    };
    crate::Weight::new(dtype, shape, crate::WeightBytes::owned(&bytes)).unwrap()
}

/// A test FP8 block weight standing for `values` (`[n, k]`): each block scaled so its largest
/// magnitude is e4m3's 448, as the FP8 releases' quantizers do.
#[cfg(test)]
pub(crate) fn fp8_weight_of(shape: Vec<usize>, block: [usize; 2], values: &[f32]) -> crate::Weight {
    use crate::cpu::fp8::{BlockScales, E4m3};
    let [_, k] = shape[..] else {
        panic!("FP8 weights are matrices")
    };
    let scales = moeserve_core::fp8::block_scales(values, k, block);
    let blocks = BlockScales { block, k, scales };
    let bytes: Vec<u8> = (values.iter().enumerate())
        .map(|(i, v)| E4m3::from_f32(v / blocks.at(i / k, i % k)).0)
        .collect();
    crate::Weight::fp8(shape, crate::WeightBytes::owned(&bytes), blocks).unwrap()
}
