//! Greedy sampling on the device: argmax (ties to the lower id) and its log-probability.

use moeserve_backend::cuda::CudaElement;
use moeserve_backend::cuda::ops;

use crate::common::*;
use crate::for_each_dtype;

fn argmax_logprob_matches_the_log_softmax<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (rows, vocab) = (3, 32000);
    let mut raw = random(rows * vocab, 70, 8.0);
    raw[5] = 20.0; // row 0: a clear maximum
    raw[vocab + 100] = 20.0; // row 1: a tie, the lower id wins
    raw[vocab + 31999] = 20.0;
    let (logits, logits_f32) = rounded::<T>(&raw);
    let logits_d = upload(gpu, &logits);
    let mut ids = gpu.zeros::<i32>(rows).unwrap();
    let mut logprobs = gpu.zeros::<f32>(rows).unwrap();
    ops::argmax_logprob(
        gpu,
        logits_d.as_view(),
        ids.as_view_mut(),
        logprobs.as_view_mut(),
    )
    .unwrap();
    let (ids, logprobs) = (
        gpu.download(&ids).unwrap(),
        gpu.download(&logprobs).unwrap(),
    );
    for r in 0..rows {
        let row = &logits_f32[r * vocab..][..vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want_id = row.iter().position(|v| *v == max).unwrap() as i32;
        let lse = row
            .iter()
            .map(|v| ((v - max) as f64).exp())
            .sum::<f64>()
            .ln();
        assert_eq!(ids[r], want_id, "row {r}");
        assert!(
            (logprobs[r] as f64 + lse).abs() < 1e-4,
            "row {r}: {} vs {}",
            logprobs[r],
            -lse
        );
    }
    assert_eq!(&ids[..2], &[5, 100]);
}
for_each_dtype!(
    argmax_logprob_matches_the_log_softmax,
    argmax_logprob_matches_the_log_softmax
);
