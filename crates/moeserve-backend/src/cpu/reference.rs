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
        DType::Mxfp4 => return mxfp4_weight_of(shape, values),
        DType::Int4 => return int4_weight_of(shape, 32, false, values),
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

/// A test MXFP4 weight standing for `values` (`[n, k]`, `k` a multiple of 32), quantised as the
/// OCP MX spec says: per 32 elements the exponent `floor(log2(amax)) - 2`, each element the
/// nearest e2m1 value (saturating at 6).
#[cfg(test)]
pub(crate) fn mxfp4_weight_of(shape: Vec<usize>, values: &[f32]) -> crate::Weight {
    use crate::cpu::mxfp4::{BLOCK, E2M1, Mxfp4Panels};
    let [n, k] = shape[..] else {
        panic!("MXFP4 weights are matrices")
    };
    let (mut bytes, mut scales) = (vec![0u8; n * k / 2], vec![0u8; n * k / BLOCK]);
    for (b, block) in values.chunks_exact(BLOCK).enumerate() {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let exp = if amax > 0.0 {
            amax.log2().floor() as i32 - 2
        } else {
            0
        }
        .clamp(-127, 127);
        scales[b] = (exp + 127) as u8;
        for (i, v) in block.iter().enumerate() {
            let x = v / 2f32.powi(exp);
            let code = (0..8)
                .min_by(|&a, &c| {
                    (x.abs() - E2M1[a])
                        .abs()
                        .total_cmp(&(x.abs() - E2M1[c]).abs())
                })
                .unwrap() as u8
                | (u8::from(x < 0.0) << 3);
            bytes[(b * BLOCK + i) / 2] |= code << (4 * (i % 2));
        }
    }
    let row = |r: usize| {
        (
            &bytes[r * k / 2..(r + 1) * k / 2],
            &scales[r * k / BLOCK..(r + 1) * k / BLOCK],
        )
    };
    crate::Weight::mxfp4(Mxfp4Panels::from_rows(n, k, row).unwrap())
}

/// A test int4 weight standing for `values` (`[n, k]`), quantised as GPTQ's round-to-nearest
/// quantizer does per group and row (range widened to include 0, 15 steps, zero point
/// `round(−min / scale)`, f16 scales). `act_order`: position `p` belongs to group
/// `((p · 37) mod k) / group`, groups scattered along the row as act-order's `g_idx` are.
#[cfg(test)]
pub(crate) fn int4_weight_of(
    shape: Vec<usize>,
    group: usize,
    act_order: bool,
    values: &[f32],
) -> crate::Weight {
    use crate::cpu::int4::{GroupOf, Int4Panels, Int4Source};
    let [n, k] = shape[..] else {
        panic!("int4 weights are matrices")
    };
    let groups = k.div_ceil(group);
    let group_of = |p: usize| {
        if act_order {
            (p * 37) % k / group
        } else {
            p / group
        }
    };
    let (mut scales, mut zeros) = (vec![0.0f32; groups * n], vec![0u32; groups * n]);
    for r in 0..n {
        for g in 0..groups {
            let members = (0..k)
                .filter(|&p| group_of(p) == g)
                .map(|p| values[r * k + p]);
            let (lo, hi) = members.fold((0.0f32, 0.0f32), |(lo, hi), v| (lo.min(v), hi.max(v)));
            let scale = half::f16::from_f32(((hi - lo) / 15.0).max(1e-6)).to_f32();
            scales[g * n + r] = scale;
            zeros[g * n + r] = (-lo / scale).round().clamp(0.0, 15.0) as u32;
        }
    }
    let code = |r: usize, p: usize| {
        let g = group_of(p) * n + r;
        ((values[r * k + p] / scales[g]).round() + zeros[g] as f32).clamp(0.0, 15.0) as u8
    };
    let group_of = if act_order {
        GroupOf::Index((0..k).map(|p| group_of(p) as u32).collect())
    } else {
        GroupOf::Runs(group)
    };
    let src = Int4Source {
        code,
        scale: |g: usize, r: usize| scales[g * n + r],
        zero: |g: usize, r: usize| zeros[g * n + r],
    };
    crate::Weight::int4(Int4Panels::new((n, k), groups, group_of, src).unwrap())
}

/// An int8 weight as `--quantization int8` makes it from `values` (`[n, k]`), in a process
/// that runs as stored: its panels made here, whatever the process chose.
#[cfg(test)]
pub(crate) fn int8_weight_of(shape: Vec<usize>, values: &[f32]) -> crate::Weight {
    use crate::cpu::packed::PackedWeight;
    let [n, k] = shape[..] else {
        panic!("int8 weights are matrices")
    };
    let packed = PackedWeight::pack_int8(crate::WeightData::F32(values), n, k);
    weight_of(moeserve_core::DType::F32, shape, values).with_packed(packed)
}
