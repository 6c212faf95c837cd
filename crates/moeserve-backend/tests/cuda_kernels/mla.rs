//! Multi-head latent attention's row kernels (mla.cu) and the prefix RMSNorm against the CPU's
//! operations as `moeserve-model`'s `layers/mla.rs` composes them.

use moeserve_backend::cpu;
use moeserve_backend::cuda::CudaElement;
use moeserve_backend::cuda::ops::{self, LatentRopeArgs, LatentShape};

use crate::common::*;
use crate::for_each_dtype;

/// DeepSeek-V3's head shapes (nope 128, rope 64, rank 512) on 4 heads.
const SHAPE: LatentShape = LatentShape {
    num_heads: 4,
    nope: 128,
    rope: 64,
    rank: 512,
};

fn mla_rope_turns_the_rotary_slices_only<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let s = SHAPE;
    let (qk, latent) = (s.nope + s.rope, s.rank + s.rope);
    let positions: Vec<i32> = vec![0, 3, 255, 4096, 16383];
    let n = positions.len();
    let inv_freq = cpu::rope_inv_freq(s.rope, 10_000.0);
    for (interleave, scaling) in [(false, 1.0), (true, 1.2079)] {
        let (q, q_f32) = rounded::<T>(&random(n * s.num_heads * qk, 40, 2.0));
        let (rows, rows_f32) = rounded::<T>(&random(n * latent, 41, 2.0));
        let (mut q_d, mut rows_d) = (upload(gpu, &q), upload(gpu, &rows));
        let (pos_d, freq_d) = (
            gpu.upload(&positions).unwrap(),
            gpu.upload(&inv_freq).unwrap(),
        );
        ops::mla_rope(
            gpu,
            LatentRopeArgs {
                q: q_d.as_view_mut(),
                latent: rows_d.as_view_mut(),
                positions: pos_d.as_view(),
                inv_freq: freq_d.as_view(),
                shape: s,
                interleave,
                scaling,
            },
        )
        .unwrap();
        let turn = match interleave {
            true => cpu::apply_rope_interleaved,
            false => cpu::apply_rope,
        };
        let (mut want_q, mut want_rows) = (q_f32, rows_f32);
        for (t, p) in positions.iter().enumerate() {
            let mut angles = cpu::RopeAngles::default();
            angles.set_scaled(*p as usize, &inv_freq, scaling);
            for head in want_q[t * s.num_heads * qk..][..s.num_heads * qk].chunks_exact_mut(qk) {
                turn(&mut head[s.nope..], s.rope, &angles);
            }
            turn(
                &mut want_rows[t * latent + s.rank..][..s.rope],
                s.rope,
                &angles,
            );
        }
        let tol = tolerance(T::DTYPE);
        let op = format!("mla_rope interleave={interleave}");
        assert_close(&op, T::DTYPE, &download_f32(gpu, &q_d), &want_q, tol);
        assert_close(&op, T::DTYPE, &download_f32(gpu, &rows_d), &want_rows, tol);
    }
}
for_each_dtype!(
    mla_rope_turns_the_rotary_slices_only,
    mla_rope_turns_the_rotary_slices_only
);

/// The rotary queries beside the absorbed ones, the latent rows into their slots, and
/// `kv_a_layernorm` on the latent part of each row: exact moves and the CPU's norm.
fn latent_rows_are_copied_written_and_normed<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let s = SHAPE;
    let (qk, latent) = (s.nope + s.rope, s.rank + s.rope);
    let n = 3;
    let (q, q_f32) = rounded::<T>(&random(n * s.num_heads * qk, 42, 1.0));
    let mut latent_q = upload(gpu, &vec![T::from_f32(7.0); n * s.num_heads * latent]);
    ops::mla_copy_rope(gpu, upload(gpu, &q).as_view(), latent_q.as_view_mut(), s).unwrap();
    let got = download_f32(gpu, &latent_q);
    for t in 0..n {
        for h in 0..s.num_heads {
            let row = &got[(t * s.num_heads + h) * latent..][..latent];
            assert!(
                row[..s.rank].iter().all(|v| *v == 7.0),
                "absorbed part kept"
            );
            assert_eq!(
                row[s.rank..],
                q_f32[(t * s.num_heads + h) * qk + s.nope..][..s.rope]
            );
        }
    }

    let (rows, rows_f32) = rounded::<T>(&random(n * latent, 43, 1.0));
    let rows_d = upload(gpu, &rows);
    let slots: Vec<i64> = vec![9, -1, 0];
    let mut cache = gpu.zeros::<T>(16 * latent).unwrap();
    let slots_d = gpu.upload(&slots).unwrap();
    ops::write_latent(
        gpu,
        rows_d.as_view(),
        cache.as_view_mut(),
        slots_d.as_view(),
        latent,
    )
    .unwrap();
    let cached = download_f32(gpu, &cache);
    let mut want = vec![0.0; 16 * latent];
    for (t, slot) in slots.iter().enumerate() {
        if *slot >= 0 {
            want[*slot as usize * latent..][..latent]
                .copy_from_slice(&rows_f32[t * latent..][..latent]);
        }
    }
    assert_eq!(cached, want, "write_latent");

    let (gain, gain_f32) = rounded::<T>(&random(s.rank, 44, 2.0));
    let mut normed = upload(gpu, &rows);
    ops::rms_norm_row_prefixes(
        gpu,
        normed.as_view_mut(),
        upload(gpu, &gain).as_view(),
        latent,
        1e-6,
    )
    .unwrap();
    let gain_w = weight_of::<T>(vec![s.rank], &gain_f32);
    let mut want = rows_f32.clone();
    for row in want.chunks_exact_mut(latent) {
        cpu::rms_norm_in_place(&mut row[..s.rank], &gain_w, 1e-6);
    }
    assert_close(
        "rms_norm_row_prefixes",
        T::DTYPE,
        &download_f32(gpu, &normed),
        &want,
        tolerance(T::DTYPE),
    );
}
for_each_dtype!(
    latent_rows_are_copied_written_and_normed,
    latent_rows_are_copied_written_and_normed
);
