//! Scalar reference kernels: the definition every optimised variant is tested against.

use half::{bf16, f16};

pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(a, b)| a * b).sum()
}

pub fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
}

pub fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
}

/// `out[i, j] = sum_k x[i, k] * w[j, k]` for row-major `x: [m, k]`, `w: [n, k]` given as f32.
pub fn matmul_wt(x: &[f32], m: usize, w: &[f32], n: usize, out: &mut [f32]) {
    let k = x.len() / m;
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = dot_f32(&w[j * k..(j + 1) * k], &x[i * k..(i + 1) * k]);
        }
    }
}
