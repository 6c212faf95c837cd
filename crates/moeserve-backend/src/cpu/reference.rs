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
