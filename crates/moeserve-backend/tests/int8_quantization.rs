//! `--quantization int8` end to end through `Weight` (its own test process: the choice is
//! process-wide).

use half::bf16;
use moeserve_backend::cpu::{self, WeightQuantization};
use moeserve_backend::{Weight, WeightBytes};
use moeserve_core::DType;

fn bf16_weight(n: usize, k: usize) -> (Weight, Vec<f32>) {
    let values: Vec<f32> = (0..n * k)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
        .collect();
    let w = Weight::new(DType::BF16, vec![n, k], WeightBytes::owned(&bytes)).unwrap();
    let rounded = values.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
    (w, rounded)
}

#[test]
fn int8_weights_halve_the_bytes_and_stay_close_to_bf16() {
    if !cpu::isa().packs_weights() {
        assert!(cpu::set_weight_quantization(WeightQuantization::Int8).is_err());
        return;
    }
    cpu::set_weight_quantization(WeightQuantization::Int8).unwrap();
    assert!(
        cpu::set_weight_quantization(WeightQuantization::None).is_err(),
        "the choice is made once"
    );
    let (n, k) = (70, 300);
    let (w, values) = bf16_weight(n, k);
    let (router, _) = bf16_weight(n, k);
    let router = router.exact();
    let x: Vec<f32> = (0..2 * k)
        .map(|i| ((i * 13) % 29) as f32 / 29.0 - 0.5)
        .collect();
    let (mut got, mut exact) = (vec![0.0; 2 * n], vec![0.0; 2 * n]);
    cpu::matmul_wt(&x, 2, &w, &mut got);
    cpu::matmul_wt(&x, 2, &router, &mut exact);
    // 70 rows in 3 panels of 32 (the last padded): int8 data + f32 scales and offsets, stored
    // per panel. Five of each per row: k = 300 spans five groups of 64.
    assert_eq!(
        w.kernel_bytes(),
        3 * 32 * k + 2 * 4 * 3 * 32 * k.div_ceil(64)
    );
    assert_eq!(
        router.kernel_bytes(),
        3 * 32 * k * 2,
        "an exact weight keeps bf16"
    );
    let mut want = vec![0.0; 2 * n];
    cpu::reference::matmul_wt(&x, 2, &values, n, &mut want);
    for (e, v) in exact.iter().zip(&want) {
        assert!((e - v).abs() <= 1e-4 * (1.0 + v.abs()));
    }
    // Per-row rounding error ≤ scale / 2 per element: relative error well under 1 %. The
    // integer products' 15-bit activations add nothing visible: 0.009185 here, 0.009187 when
    // the GEMM multiplied the dequantised weights by f32 activations.
    let err: f32 = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .sum::<f32>();
    let norm: f32 = want.iter().map(|b| b.abs()).sum::<f32>();
    assert!(err / norm < 0.01, "relative error {}", err / norm);
}
