//! Row-wise kernels and the dense GEMM: embedding, row gather, RMSNorm with the residual add,
//! SwiGLU, RoPE, the KV-cache write, cuBLAS `x · wᵀ`, and the families' options (bias, clamp,
//! gated add, q/k RMSNorm).

use moeserve_backend::cpu;
use moeserve_backend::cuda::CudaElement;
use moeserve_backend::cuda::gemm::{GemmShape, matmul_wt};
use moeserve_backend::cuda::ops::{
    self, EmbeddingArgs, GatherRowsArgs, RmsNormArgs, RopeArgs, WriteKvArgs,
};

use crate::common::*;
use crate::for_each_dtype;

fn embedding_gathers_exact_rows<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (vocab, hidden) = (50, 96);
    let (table, table_f32) = rounded::<T>(&random(vocab * hidden, 1, 1.0));
    let ids: Vec<u32> = vec![3, 0, 49, 3, 17];
    let table_d = upload(gpu, &table);
    let ids_d = gpu.upload(&ids).unwrap();
    let mut out = gpu.zeros::<f32>(ids.len() * hidden).unwrap();
    ops::embedding(
        gpu,
        EmbeddingArgs {
            table: table_d.as_view(),
            ids: ids_d.as_view(),
            out: out.as_view_mut(),
            hidden,
        },
    )
    .unwrap();
    let got = gpu.download(&out).unwrap();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|id| table_f32[*id as usize * hidden..][..hidden].to_vec())
        .collect();
    assert_eq!(got, want);
    // And the last-token gather of f32 rows.
    let rows: Vec<i32> = vec![4, 1];
    let rows_d = gpu.upload(&rows).unwrap();
    let mut picked = gpu.zeros::<f32>(rows.len() * hidden).unwrap();
    ops::gather_rows(
        gpu,
        GatherRowsArgs {
            src: out.as_view(),
            rows: rows_d.as_view(),
            dst: picked.as_view_mut(),
            hidden,
        },
    )
    .unwrap();
    let want: Vec<f32> = rows
        .iter()
        .flat_map(|r| got[*r as usize * hidden..][..hidden].to_vec())
        .collect();
    assert_eq!(gpu.download(&picked).unwrap(), want);
}
for_each_dtype!(embedding_gathers_exact_rows, embedding_gathers_exact_rows);

fn rms_norm_adds_the_residual_then_normalises<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (tokens, hidden, eps) = (7, 1000, 1e-5);
    let residual = random(tokens * hidden, 2, 3.0);
    let (delta, delta_f32) = rounded::<T>(&random(tokens * hidden, 3, 1.0));
    let (gain, gain_f32) = rounded::<T>(&random(hidden, 4, 2.0));
    let mut residual_d = gpu.upload(&residual).unwrap();
    let (delta_d, gain_d) = (upload(gpu, &delta), upload(gpu, &gain));
    let mut out = gpu.zeros::<T>(tokens * hidden).unwrap();
    for with_delta in [true, false] {
        let mut want_residual = gpu.download(&residual_d).unwrap();
        if with_delta {
            cpu::add_assign(&mut want_residual, &delta_f32);
        }
        ops::rms_norm_residual(
            gpu,
            RmsNormArgs {
                residual: residual_d.as_view_mut(),
                delta: with_delta.then(|| delta_d.as_view()),
                weight: gain_d.as_view(),
                out: out.as_view_mut(),
                eps,
            },
        )
        .unwrap();
        assert_eq!(
            gpu.download(&residual_d).unwrap(),
            want_residual,
            "the residual add is exact"
        );
        let mut want = vec![0.0; tokens * hidden];
        cpu::rms_norm(
            &want_residual,
            &weight_of::<T>(vec![hidden], &gain_f32),
            eps,
            &mut want,
        );
        assert_close(
            "rms_norm_residual",
            T::DTYPE,
            &download_f32(gpu, &out),
            &want,
            tolerance(T::DTYPE),
        );
    }
}
for_each_dtype!(
    rms_norm_adds_the_residual_then_normalises,
    rms_norm_adds_the_residual_then_normalises
);

fn silu_mul_matches_swiglu<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (rows, inter) = (5, 333);
    let (gate_up, gu) = rounded::<T>(&random(rows * 2 * inter, 5, 6.0));
    let gate_up_d = upload(gpu, &gate_up);
    let mut out = gpu.zeros::<T>(rows * inter).unwrap();
    ops::silu_mul(gpu, gate_up_d.as_view(), out.as_view_mut(), inter).unwrap();
    let mut want = Vec::new();
    for row in gu.chunks_exact(2 * inter) {
        let mut gate = row[..inter].to_vec();
        cpu::silu_mul(&mut gate, &row[inter..]);
        want.extend(gate);
    }
    assert_close(
        "silu_mul",
        T::DTYPE,
        &download_f32(gpu, &out),
        &want,
        tolerance(T::DTYPE),
    );
}
for_each_dtype!(silu_mul_matches_swiglu, silu_mul_matches_swiglu);

fn clamped_swiglu_matches_the_cpu<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    // Values of ±6 against GPT-OSS's limit 7 and a smaller one, so both clamps bite.
    let (rows, inter) = (5, 333);
    let (gate_up, gu) = rounded::<T>(&random(rows * 2 * inter, 6, 6.0));
    let gate_up_d = upload(gpu, &gate_up);
    for act in [
        cpu::GatedActivation::ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0,
        },
        cpu::GatedActivation::ClampedSwiglu {
            alpha: 1.702,
            limit: 1.5,
        },
    ] {
        let mut out = gpu.zeros::<T>(rows * inter).unwrap();
        ops::gated_activation(gpu, gate_up_d.as_view(), out.as_view_mut(), inter, act).unwrap();
        let mut want = Vec::new();
        for row in gu.chunks_exact(2 * inter) {
            let mut gate = row[..inter].to_vec();
            act.apply(&mut gate, &row[inter..]);
            want.extend(gate);
        }
        assert_close(
            &format!("{act:?}"),
            T::DTYPE,
            &download_f32(gpu, &out),
            &want,
            tolerance(T::DTYPE),
        );
    }
}
for_each_dtype!(
    clamped_swiglu_matches_the_cpu,
    clamped_swiglu_matches_the_cpu
);

fn segment_bias_adds_each_experts_bias_to_its_rows<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    // Four segments of 3, 0, 5 and 1 rows (an empty one included), in a buffer of 12 rows.
    let (width, offsets) = (70, [0i32, 3, 3, 8, 9]);
    let rows = 12;
    let (x, x_f32) = rounded::<T>(&random(rows * width, 7, 1.0));
    let bias = random(4 * width, 8, 1.0);
    let mut x_d = upload(gpu, &x);
    let (bias_d, offsets_d) = (gpu.upload(&bias).unwrap(), gpu.upload(&offsets).unwrap());
    ops::add_segment_bias(
        gpu,
        x_d.as_view_mut(),
        bias_d.as_view(),
        offsets_d.as_view(),
        width,
    )
    .unwrap();
    let mut want = x_f32.clone();
    for (e, segment) in offsets.windows(2).enumerate() {
        for r in segment[0] as usize..segment[1] as usize {
            for c in 0..width {
                want[r * width + c] += bias[e * width + c];
            }
        }
    }
    // Rows past the last segment are left alone.
    assert_eq!(&want[9 * width..], &x_f32[9 * width..]);
    assert_close(
        "add_segment_bias",
        T::DTYPE,
        &download_f32(gpu, &x_d),
        &want,
        tolerance(T::DTYPE),
    );
}
for_each_dtype!(
    segment_bias_adds_each_experts_bias_to_its_rows,
    segment_bias_adds_each_experts_bias_to_its_rows
);

fn rope_matches_hf_rotate_half<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (heads, kv_heads, d) = (8, 2, 128);
    let positions: Vec<i32> = vec![0, 1, 17, 4095, 32767];
    let n = positions.len();
    // The whole head, then its first half only (GLM-4.5's partial_rotary_factor 0.5) with
    // the cos/sin scaled as YaRN scales them.
    for (rotary, scaling) in [(d, 1.0), (d / 2, 1.1386)] {
        let inv_freq = cpu::rope_inv_freq(rotary, 1e6);
        let (q, q_f32) = rounded::<T>(&random(n * heads * d, 6, 2.0));
        let (k, k_f32) = rounded::<T>(&random(n * kv_heads * d, 7, 2.0));
        let (mut q_d, mut k_d) = (upload(gpu, &q), upload(gpu, &k));
        let (pos_d, freq_d) = (
            gpu.upload(&positions).unwrap(),
            gpu.upload(&inv_freq).unwrap(),
        );
        ops::rope(
            gpu,
            RopeArgs {
                q: q_d.as_view_mut(),
                k: k_d.as_view_mut(),
                positions: pos_d.as_view(),
                inv_freq: freq_d.as_view(),
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: d,
                rotary_dim: rotary,
                scaling,
            },
        )
        .unwrap();
        let (mut want_q, mut want_k) = (q_f32, k_f32);
        for (i, p) in positions.iter().enumerate() {
            let mut angles = cpu::RopeAngles::default();
            angles.set_scaled(*p as usize, &inv_freq, scaling);
            cpu::apply_rope(&mut want_q[i * heads * d..][..heads * d], d, &angles);
            cpu::apply_rope(&mut want_k[i * kv_heads * d..][..kv_heads * d], d, &angles);
        }
        let tol = tolerance(T::DTYPE);
        assert_close("rope q", T::DTYPE, &download_f32(gpu, &q_d), &want_q, tol);
        assert_close("rope k", T::DTYPE, &download_f32(gpu, &k_d), &want_k, tol);
    }
}
for_each_dtype!(rope_matches_hf_rotate_half, rope_matches_hf_rotate_half);

fn write_kv_fills_the_mapped_slots_only<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (num_slots, kv_dim) = (64, 40);
    let slots: Vec<i64> = vec![5, 63, -1, 0, 17];
    let n = slots.len();
    let (k, k_f32) = rounded::<T>(&random(n * kv_dim, 8, 1.0));
    let (v, v_f32) = rounded::<T>(&random(n * kv_dim, 9, 1.0));
    let (k_d, v_d) = (upload(gpu, &k), upload(gpu, &v));
    let slots_d = gpu.upload(&slots).unwrap();
    let mut k_cache = gpu.zeros::<T>(num_slots * kv_dim).unwrap();
    let mut v_cache = gpu.zeros::<T>(num_slots * kv_dim).unwrap();
    ops::write_kv(
        gpu,
        WriteKvArgs {
            k: k_d.as_view(),
            v: v_d.as_view(),
            k_cache: k_cache.as_view_mut(),
            v_cache: v_cache.as_view_mut(),
            slot_mapping: slots_d.as_view(),
            kv_dim,
        },
    )
    .unwrap();
    let (mut want_k, mut want_v) = (vec![0.0; num_slots * kv_dim], vec![0.0; num_slots * kv_dim]);
    for (i, s) in slots.iter().enumerate() {
        if *s >= 0 {
            let s = *s as usize;
            want_k[s * kv_dim..][..kv_dim].copy_from_slice(&k_f32[i * kv_dim..][..kv_dim]);
            want_v[s * kv_dim..][..kv_dim].copy_from_slice(&v_f32[i * kv_dim..][..kv_dim]);
        }
    }
    assert_eq!(download_f32(gpu, &k_cache), want_k);
    assert_eq!(download_f32(gpu, &v_cache), want_v);
}
for_each_dtype!(
    write_kv_fills_the_mapped_slots_only,
    write_kv_fills_the_mapped_slots_only
);

fn cublas_matmul_wt_matches_the_reference<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (n, k) = (96, 256);
    let (w, w_f32) = rounded::<T>(&random(n * k, 10, 0.1));
    let w_d = upload(gpu, &w);
    for m in [1, 7, 64] {
        let (x, x_f32) = rounded::<T>(&random(m * k, 11 + m as u64, 1.0));
        let x_d = upload(gpu, &x);
        let mut y = gpu.zeros::<T>(m * n).unwrap();
        matmul_wt(
            gpu,
            &x_d.as_view(),
            &w_d.as_view(),
            &mut y.as_view_mut(),
            GemmShape { m, n, k },
        )
        .unwrap();
        let mut want = vec![0.0; m * n];
        cpu::reference::matmul_wt(&x_f32, m, &w_f32, n, &mut want);
        assert_close(
            "matmul_wt",
            T::DTYPE,
            &download_f32(gpu, &y),
            &want,
            tolerance(T::DTYPE) * 10.0,
        );
    }
}
for_each_dtype!(
    cublas_matmul_wt_matches_the_reference,
    cublas_matmul_wt_matches_the_reference
);

fn fill_uniform_is_seeded_and_in_range<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let n = 100_003;
    let fill = |seed| {
        let mut w = gpu.zeros::<T>(n).unwrap();
        ops::fill_uniform(gpu, w.as_view_mut(), seed, 0.5).unwrap();
        download_f32(gpu, &w)
    };
    let (a, b, c) = (fill(7), fill(7), fill(8));
    assert_eq!(a, b, "same seed, same values");
    assert_ne!(a, c, "another seed, other values");
    assert!(a.iter().all(|v| (-0.5..=0.5).contains(v)));
    let mean = a.iter().map(|v| *v as f64).sum::<f64>() / n as f64;
    let var = a.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
    // Uniform(-0.5, 0.5): mean 0, variance 1/12.
    assert!(
        mean.abs() < 0.01 && (var - 1.0 / 12.0).abs() < 0.005,
        "{mean} {var}"
    );
}
for_each_dtype!(
    fill_uniform_is_seeded_and_in_range,
    fill_uniform_is_seeded_and_in_range
);

/// The families' options: a projection bias, the `clip_qkv` clamp, the shared expert's gated
/// add and the q/k RMSNorm over rows of a head or a projection, each against the CPU's.
fn family_options_match_the_cpu<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (rows, width) = (6, 96);
    let tol = tolerance(T::DTYPE);
    let (x, x_f32) = rounded::<T>(&random(rows * width, 60, 3.0));
    let (bias, bias_f32) = rounded::<T>(&random(width, 61, 1.0));
    let mut x_d = upload(gpu, &x);
    ops::add_bias(gpu, x_d.as_view_mut(), upload(gpu, &bias).as_view()).unwrap();
    let mut want = x_f32.clone();
    cpu::add_bias(&mut want, &weight_of::<T>(vec![width], &bias_f32));
    assert_close("add_bias", T::DTYPE, &download_f32(gpu, &x_d), &want, tol);

    let mut x_d = upload(gpu, &x);
    ops::clamp(gpu, x_d.as_view_mut(), 1.5).unwrap();
    let want: Vec<f32> = x_f32.iter().map(|v| v.clamp(-1.5, 1.5)).collect();
    assert_eq!(download_f32(gpu, &x_d), want, "clamping is exact");

    let (src, src_f32) = rounded::<T>(&random(rows * width, 62, 2.0));
    let (gate, gate_f32) = rounded::<T>(&random(rows, 63, 4.0));
    for gated in [true, false] {
        let mut delta_d = upload(gpu, &x);
        let gate_d = upload(gpu, &gate);
        ops::add_gated(
            gpu,
            delta_d.as_view_mut(),
            upload(gpu, &src).as_view(),
            gated.then(|| gate_d.as_view()),
            width,
        )
        .unwrap();
        let want: Vec<f32> = x_f32
            .iter()
            .zip(&src_f32)
            .enumerate()
            .map(|(i, (d, s))| {
                let g = if gated {
                    1.0 / (1.0 + (-gate_f32[i / width]).exp())
                } else {
                    1.0
                };
                d + g * s
            })
            .collect();
        assert_close(
            "add_gated",
            T::DTYPE,
            &download_f32(gpu, &delta_d),
            &want,
            tol,
        );
    }

    // Per head (rows of 32) and over the whole row.
    for norm_width in [32, width] {
        let (gain, gain_f32) = rounded::<T>(&random(norm_width, 64, 2.0));
        let mut x_d = upload(gpu, &x);
        ops::rms_norm_rows(gpu, x_d.as_view_mut(), upload(gpu, &gain).as_view(), 1e-6).unwrap();
        let mut want = x_f32.clone();
        cpu::rms_norm_in_place(
            &mut want,
            &weight_of::<T>(vec![norm_width], &gain_f32),
            1e-6,
        );
        assert_close(
            "rms_norm_rows",
            T::DTYPE,
            &download_f32(gpu, &x_d),
            &want,
            tol,
        );
    }
}
for_each_dtype!(family_options_match_the_cpu, family_options_match_the_cpu);

/// A forked sequence's copy of a KV block: one range of a buffer into another, both ways.
fn copy_within_moves_one_range_and_nothing_else<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (values, values_f32) = rounded::<T>(&random(64, 9, 1.0));
    let mut buf = upload(gpu, &values);
    gpu.copy_within(&mut buf, 40, 8, 16).unwrap();
    let mut want = values_f32.clone();
    want.copy_within(40..56, 8);
    assert_eq!(
        download_f32(gpu, &buf),
        want,
        "later range to an earlier one"
    );
    gpu.copy_within(&mut buf, 0, 48, 16).unwrap();
    want.copy_within(0..16, 48);
    assert_eq!(
        download_f32(gpu, &buf),
        want,
        "earlier range to a later one"
    );
}
for_each_dtype!(
    copy_within_moves_one_range_and_nothing_else,
    copy_within_moves_one_range_and_nothing_else
);
