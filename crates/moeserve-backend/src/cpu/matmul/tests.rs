//! `matmul`'s tests: every stored type against the scalar reference or its dequantised
//! weights, batch invariance, and the AVX2 and AVX-512 paths bit for bit.
use super::*;
use crate::cpu::reference::{self, pseudo_random, weight_of};
use moeserve_core::DType;

/// Every element of `got` within 1e-5 (relative, plus an absolute 1e-5) of `want`.
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    for (a, b) in got.iter().zip(want) {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "{what}: {a} vs {b}"
        );
    }
}

#[test]
fn matches_scalar_reference_for_every_dtype_and_odd_sizes() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (m, n, k) in [
            (1, 7, 5),
            (3, 100, 67),
            (5, 257, 130),
            (1, 1024, 256),
            (37, 65, 96),
            (13, 40, 600),
            (25, 33, 257),
        ] {
            let x = pseudo_random(m * k, 1);
            let wv = pseudo_random(n * k, 2);
            let w = weight_of(dtype, vec![n, k], &wv);
            let mut out = vec![0.0; m * n];
            matmul_wt(&x, m, &w, &mut out);
            let mut want = vec![0.0; m * n];
            reference::matmul_wt(&x, m, &w.to_f32_vec(), n, &mut want);
            for (a, b) in out.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{dtype} {m}x{n}x{k}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn each_row_is_bit_identical_whatever_the_batch() {
    // k = 700 spans several blocks; 40 and 30 rows cut into tiles of different sizes; 3 rows
    // are one full-width tile on AVX2 (its hand-scheduled loop), 4, 5 and 6 one half-panel
    // tile, 8 two of 4.
    let shapes = [
        (40, 70, 200),
        (30, 45, 700),
        (3, 70, 300),
        (4, 33, 257),
        (5, 40, 130),
        (6, 64, 300),
        (8, 70, 300),
    ];
    for (dtype, (m, n, k)) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .flat_map(|t| shapes.map(|s| (t, s)))
    {
        let x = pseudo_random(m * k, 3);
        let w = weight_of(dtype, vec![n, k], &pseudo_random(n * k, 4));
        let mut batched = vec![0.0; m * n];
        matmul_wt(&x, m, &w, &mut batched);
        for i in 0..m {
            let mut alone = vec![0.0; n];
            matmul_wt(&x[i * k..(i + 1) * k], 1, &w, &mut alone);
            assert_eq!(&batched[i * n..(i + 1) * n], &alone[..], "{dtype} row {i}");
        }
    }
}

#[test]
fn several_products_of_one_input_equal_each_alone_bit_for_bit() {
    // Three weights as a layer's q, k and v (odd panel counts: a lone last panel where one
    // row pairs panels), every stored type, one row (panels in pairs on AVX2) and several.
    let k = 320; // whole MXFP4 blocks
    let ns = [70, 33, 33];
    let weights = |seed: u32| -> Vec<Vec<crate::Weight>> {
        let values = |n: usize, i: u32| pseudo_random(n * k, seed + i);
        vec![
            (ns.iter().zip(0..))
                .map(|(&n, i)| weight_of(DType::BF16, vec![n, k], &values(n, i)))
                .collect(),
            (ns.iter().zip(0..))
                .map(|(&n, i)| weight_of(DType::F16, vec![n, k], &values(n, i)))
                .collect(),
            (ns.iter().zip(0..))
                .map(|(&n, i)| weight_of(DType::F32, vec![n, k], &values(n, i)))
                .collect(),
            (ns.iter().zip(0..))
                .map(|(&n, i)| reference::fp8_weight_of(vec![n, k], [32, 128], &values(n, i)))
                .collect(),
            (ns.iter().zip(0..))
                .map(|(&n, i)| reference::mxfp4_weight_of(vec![n, k], &values(n, i)))
                .collect(),
            // Integer weights that quantize the input alike: quantized once, one job.
            (ns.iter().zip(0..))
                .map(|(&n, i)| reference::int8_weight_of(vec![n, k], &values(n, i)))
                .collect(),
            (ns.iter().zip(0..))
                .map(|(&n, i)| reference::int4_weight_of(vec![n, k], 32, false, &values(n, i)))
                .collect(),
            // GPTQ act-order: each weight its own order, so one by one.
            (ns.iter().zip(0..))
                .map(|(&n, i)| reference::int4_weight_of(vec![n, k], 64, true, &values(n, i)))
                .collect(),
            // Mixed: an integer weight among them runs the products one by one.
            vec![
                weight_of(DType::BF16, vec![ns[0], k], &values(ns[0], 0)),
                reference::int8_weight_of(vec![ns[1], k], &values(ns[1], 1)),
                weight_of(DType::BF16, vec![ns[2], k], &values(ns[2], 2)),
            ],
        ]
    };
    for (set, ws) in weights(20).iter().enumerate() {
        for m in [1, 2, 7] {
            let x = pseudo_random(m * k, 9);
            let mut outs: Vec<Vec<f32>> = ns.iter().map(|n| vec![f32::NAN; m * n]).collect();
            let [a, b, c] = &mut outs[..] else {
                unreachable!()
            };
            let products = [
                (&ws[0], &mut a[..]),
                (&ws[1], &mut b[..]),
                (&ws[2], &mut c[..]),
            ];
            matmul_wt_many(&x, m, products, &mut Vec::new());
            for ((w, got), n) in ws.iter().zip(&outs).zip(ns) {
                let mut alone = vec![0.0; m * n];
                matmul_wt(&x, m, w, &mut alone);
                assert_eq!(got, &alone, "weight set {set}, {m} rows, n = {n}");
            }
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn avx2_equals_avx512_bit_for_bit() {
    use std::arch::is_x86_feature_detected as has;
    let both = has!("avx512f") && has!("avx512bw") && has!("avx2") && has!("fma");
    if !(both && has!("f16c") && isa().packs_weights()) {
        eprintln!("skipped: needs a CPU with both AVX-512 and AVX2");
        return;
    }
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3,
        DType::Mxfp4,
        DType::Int4,
    ] {
        for (m, n, k) in [(1, 70, 300usize), (4, 33, 257), (13, 64, 600), (40, 45, 96)] {
            // MXFP4 rows are whole blocks of 32.
            let k = if dtype == DType::Mxfp4 {
                k.next_multiple_of(32)
            } else {
                k
            };
            let x = pseudo_random(m * k, 5);
            let w = weight_of(dtype, vec![n, k], &pseudo_random(n * k, 6));
            let run = |isa| {
                let mut out = vec![0.0; m * n];
                matmul_wt_on(isa, &x, m, &w, &mut out, &mut Vec::new());
                out
            };
            assert_eq!(run(Isa::Avx2), run(Isa::Avx512), "{dtype} {m}x{n}x{k}");
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn tiled_rows_from_packing_and_from_scattered_panels_agree() {
    for isa in [Isa::Avx512, Isa::Avx2] {
        for (m, k) in [(1, 5), (11, 40), (13, 70), (30, 33)] {
            let x = pseudo_random(m * k, 3);
            let mut packed = Vec::new();
            let tiled = TiledRows::pack(isa, &x, m, k, &mut packed);
            for i in 0..m {
                for p in 0..k {
                    let (i0, mr) = row_tiles(m, tiled.max_mr)
                        .find(|(i0, mr)| i < i0 + mr)
                        .unwrap();
                    assert_eq!(tiled.data[i0 * k + p * mr + i - i0], x[i * k + p]);
                }
            }
            // The same layout assembled from [m, PANEL] output panels.
            let mut scattered = vec![f32::NAN; m * k];
            for p0 in (0..k).step_by(PANEL) {
                let cols = PANEL.min(k - p0);
                let mut panel = vec![0.0; m * PANEL];
                for i in 0..m {
                    panel[i * PANEL..i * PANEL + cols]
                        .copy_from_slice(&x[i * k + p0..i * k + p0 + cols]);
                }
                // SAFETY: `scattered` holds m × k elements.
                unsafe {
                    TiledRows::scatter_columns(
                        isa,
                        &panel,
                        (m, k),
                        (p0, cols),
                        scattered.as_mut_ptr(),
                    )
                };
            }
            assert_eq!(scattered, packed, "{isa:?} {m}x{k}");
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn int8_is_the_integer_reference_on_every_dot_kernel_whatever_the_batch() {
    use crate::cpu::int8::{DotKernel, Int8Panels, reference_product};
    use crate::cpu::quant::{GROUP, quantize_rows_int8};
    let kernels: Vec<DotKernel> = [DotKernel::Vnni512, DotKernel::AvxVnni, DotKernel::Avx2Madd]
        .into_iter()
        .filter(|k| k.supported())
        .collect();
    eprintln!("int8 dot kernels on this CPU: {kernels:?}");
    // k: under a quad, not a multiple of 4 or of a group, whole groups; m: one tile of each
    // kernel, several, a 12-row AVX-512 tile.
    for (m, n, k) in [
        (1, 7, 5),
        (3, 100, 67),
        (13, 40, 600),
        (30, 45, 702),
        (2, 64, 130),
        (12, 33, 256),
    ] {
        let mut x = pseudo_random(m * k, 9);
        // Row 0's first group all zero (scale 0); activations of very different sizes.
        x[..GROUP.min(k)].fill(0.0);
        x.iter_mut().skip(k).step_by(7).for_each(|v| *v *= 50.0);
        let wv = pseudo_random(n * k, 10);
        let rows = quantize_rows_int8(WeightData::F32(&wv), n, k);
        let w = PackedWeight::I8(Int8Panels::new(&rows, n, k));
        let want = reference_product(&x, m, &rows, n, k);
        for &kernel in &kernels {
            let run = |x: &[f32], m: usize| {
                let mut out = vec![f32::NAN; m * n];
                let how = Quantizer {
                    kernel,
                    format: Format::Int8,
                    order: None,
                };
                run_integer(how, x, Dims { m, n, k }, &w, OutPtr(out.as_mut_ptr()));
                out
            };
            let got = run(&x, m);
            assert_eq!(got, want, "{kernel} {m}x{n}x{k}");
            for i in 0..m {
                let alone = run(&x[i * k..(i + 1) * k], 1);
                assert_eq!(
                    &got[i * n..(i + 1) * n],
                    &alone[..],
                    "{kernel}: row {i} alone"
                );
            }
        }
        // Against the dequantised weights in f64: off by no more than the activations'
        // rounding, half a step (max |x| / 32766 in its group) per position times |q · scale|,
        // and f32's rounding of the sums (relative to Σ |x · w|).
        let groups = k.div_ceil(GROUP);
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut bound, mut magnitude) = (0.0f64, 0.0f64, 0.0f64);
                for p in 0..k {
                    let xv = f64::from(x[i * k + p]);
                    let wv = f64::from(rows.dequantized(j * k + p, k));
                    exact += xv * wv;
                    magnitude += (xv * wv).abs();
                    let g = p / GROUP;
                    let group = &x[i * k + g * GROUP..i * k + (g * GROUP + GROUP).min(k)];
                    let amax = group.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let q_scale = f32::from(rows.q[j * k + p]) * rows.scales[j * groups + g];
                    bound += f64::from(amax / 32766.0 * q_scale.abs()) * (1.0 + 1e-3);
                }
                let got = f64::from(want[i * n + j]);
                assert!(
                    (got - exact).abs() <= bound + 1e-6 * magnitude,
                    "{m}x{n}x{k} ({i}, {j}): {got} vs {exact}, bound {bound}"
                );
            }
        }
        // A byte per weight and 8 per group and row, rows padded to panels.
        let padded = n.div_ceil(PANEL) * PANEL;
        assert_eq!(
            w.size_in_bytes(),
            padded * k.next_multiple_of(4) + padded * groups * 8
        );
    }
}

#[test]
fn fp8_blocks_match_the_reference_on_dequantized_weights_whatever_the_batch() {
    use crate::cpu::reference::fp8_weight_of;
    // Releases' 128 × 128 blocks, a wider one (KC parts), small ones with partial blocks,
    // and 48-row blocks that split panels (packed as f32).
    for (block, (m, n, k)) in [
        ([128, 128], (1, 300, 700)),
        ([128, 128], (13, 130, 256)),
        ([128, 256], (3, 128, 600)),
        ([32, 32], (5, 48, 72)),
        ([32, 32], (30, 33, 40)),
        ([48, 16], (2, 100, 50)),
    ] {
        let x = pseudo_random(m * k, 11);
        let w = fp8_weight_of(vec![n, k], block, &pseudo_random(n * k, 12));
        let run = |x: &[f32], m: usize| {
            let mut out = vec![0.0; m * n];
            matmul_wt_on(isa(), x, m, &w, &mut out, &mut Vec::new());
            out
        };
        let got = run(&x, m);
        let deq = w.to_f32_vec();
        let mut want = vec![0.0; m * n];
        reference::matmul_wt(&x, m, &deq, n, &mut want);
        for (a, b) in got.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{block:?} {m}x{n}x{k}: {a} vs {b}"
            );
        }
        for i in 0..m {
            assert_eq!(
                &got[i * n..(i + 1) * n],
                &run(&x[i * k..(i + 1) * k], 1)[..],
                "{block:?} {m}x{n}x{k}: row {i} alone"
            );
        }
        // One byte per weight in the kernels' layout (blocks that split panels excepted).
        if block[0] % PANEL == 0 {
            assert!(w.kernel_bytes() < n.div_ceil(PANEL) * PANEL * k * 2);
        }
    }
}

/// int4 multiplies in integers on the packed kernels (see `int4.rs`): the integer reference
/// bit for bit on every dot kernel this CPU has, whatever the batch, within the activations'
/// rounding of the dequantised weights' product; the portable path is that product.
#[test]
fn int4_is_the_integer_reference_on_every_dot_kernel_whatever_the_batch() {
    use crate::cpu::reference::int4_weight_of;
    // Groups of 32, a whole row (k = 700, a partial last block), 128, and act-order's
    // shuffled groups; 45 rows pad a panel; m: one tile, several, past 12.
    for (m, n, k, group, act_order) in [
        (1, 70, 256, 32, false),
        (3, 45, 700, 700, false),
        (13, 64, 384, 128, false),
        (30, 33, 96, 32, true),
        (2, 40, 160, 32, true),
    ] {
        let mut x = pseudo_random(m * k, 15);
        x.iter_mut().skip(k).step_by(7).for_each(|v| *v *= 50.0);
        let w = int4_weight_of(vec![n, k], group, act_order, &pseudo_random(n * k, 16));
        let deq = weight_of(DType::F32, vec![n, k], &w.to_f32_vec());
        let what = format!("{m}x{n}x{k} group {group} act-order {act_order}");
        let run = |isa: Isa, w: &Weight, x: &[f32], m: usize| {
            let mut out = vec![0.0; m * n];
            matmul_wt_on(isa, x, m, w, &mut out, &mut Vec::new());
            out
        };
        let exact = run(Isa::Scalar, &deq, &x, m);
        assert_close(&run(Isa::Scalar, &w, &x, m), &exact, &what);
        #[cfg(target_arch = "x86_64")]
        if isa().packs_weights() {
            let PackedWeight::Int4(panels) = w.packed() else {
                panic!("an int4 weight packs as int4")
            };
            let want = crate::cpu::int4::reference_product(&x, m, panels);
            let mut isas = vec![isa()];
            if isa() == Isa::Avx512 {
                isas.push(Isa::Avx2); // AVX-VNNI or AVX2's vpmaddwd
            }
            for isa in isas {
                let got = run(isa, &w, &x, m);
                assert_eq!(got, want, "{isa:?} {what}");
                for i in 0..m {
                    assert_eq!(
                        &got[i * n..(i + 1) * n],
                        &run(isa, &w, &x[i * k..(i + 1) * k], 1)[..],
                        "{isa:?} {what}: row {i} alone"
                    );
                }
            }
            // Half a step of the row's largest activation per position, times |w|.
            for i in 0..m {
                let row = &x[i * k..(i + 1) * k];
                let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for j in 0..n {
                    let wrow = &w.to_f32_vec()[j * k..(j + 1) * k];
                    let bound: f32 = wrow.iter().map(|v| v.abs() * amax / 8388606.0).sum();
                    let magnitude: f32 = wrow.iter().zip(row).map(|(a, b)| (a * b).abs()).sum();
                    let d = (want[i * n + j] - exact[i * n + j]).abs();
                    assert!(
                        d <= bound * 1.001 + 1e-5 * magnitude,
                        "{what} ({i}, {j}): {d} > {bound}"
                    );
                }
            }
        }
        // Half a byte per weight, plus 3 bytes per group and row (an f16 scale and a zero
        // point), 4 per block of 32 (its group) and act-order's order (whose groups here are
        // whole blocks).
        let groups = k.div_ceil(group);
        let index = if act_order { 4 * k } else { 0 };
        let padded = n.div_ceil(PANEL) * PANEL;
        assert_eq!(
            w.kernel_bytes(),
            padded * k / 2 + padded * groups * 3 + 4 * k.div_ceil(32) + index,
            "{what}"
        );
    }
}

#[test]
fn mxfp4_equals_the_dequantized_weights_in_f32_bit_for_bit_whatever_the_batch() {
    use crate::cpu::reference::mxfp4_weight_of;
    // k = 2880 is gpt-oss's width (a last block of 64 positions); 45 rows pad a panel.
    for (m, n, k) in [(1, 70, 2880), (3, 45, 96), (13, 64, 608), (30, 33, 256)] {
        let x = pseudo_random(m * k, 13);
        let w = mxfp4_weight_of(vec![n, k], &pseudo_random(n * k, 14));
        let deq = weight_of(DType::F32, vec![n, k], &w.to_f32_vec());
        let run = |w: &Weight, x: &[f32], m: usize| {
            let mut out = vec![0.0; m * n];
            matmul_wt_on(isa(), x, m, w, &mut out, &mut Vec::new());
            out
        };
        let got = run(&w, &x, m);
        if isa().packs_weights() {
            assert_eq!(got, run(&deq, &x, m), "{m}x{n}x{k}");
        } else {
            assert_close(&got, &run(&deq, &x, m), &format!("{m}x{n}x{k}"));
        }
        for i in 0..m {
            assert_eq!(
                &got[i * n..(i + 1) * n],
                &run(&w, &x[i * k..(i + 1) * k], 1)[..],
                "{m}x{n}x{k}: row {i} alone"
            );
        }
        // 4.25 bits per weight: 17/64 of bf16's bytes (panel padding aside).
        let bf16_bytes = n.div_ceil(PANEL) * PANEL * k * 2;
        assert_eq!(w.kernel_bytes() * 64, bf16_bytes * 17, "{n}x{k}");
    }
}
