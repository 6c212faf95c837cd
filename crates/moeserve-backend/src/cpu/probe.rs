//! Machine ceilings measured in the same run as a benchmark, so results can be reported as
//! ratios (the machines are shared and noisy; absolute figures drift, ratios much less).

use std::time::Instant;

use rayon::prelude::*;

/// Memory read bandwidth in GB/s: all pool threads summing disjoint parts of a `bytes`-byte
/// buffer (far larger than the caches), the best of `repeats` passes.
pub fn read_bandwidth_gbps(bytes: usize, repeats: usize) -> f64 {
    let words = vec![1u64; bytes / 8];
    let chunk = (words.len() / (4 * rayon::current_num_threads())).max(1 << 12);
    let mut best = 0.0f64;
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        let total: u64 = words.par_chunks(chunk).map(sum_words).sum();
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(total, words.len() as u64, "the buffer holds ones");
        best = best.max(bytes as f64 / secs / 1e9);
    }
    best
}

/// The sum of `words`, read with the widest loads the kernels use (the baseline target's
/// 16-byte loads cannot keep up with memory on one core).
fn sum_words(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    match super::isa() {
        // SAFETY: AVX-512F was detected.
        super::Isa::Avx512 => return unsafe { sum_words_avx512(words) },
        // SAFETY: AVX2 was detected.
        super::Isa::Avx2 => return unsafe { sum_words_avx2(words) },
        super::Isa::Scalar => {}
    }
    sum_words_portable(words)
}

/// Four 64-byte loads per round into independent sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_words_avx512(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    let mut rounds = words.chunks_exact(32);
    for r in &mut rounds {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: the round holds 32 words, 8 per load.
            let v = unsafe { _mm512_loadu_si512(r.as_ptr().add(8 * i) as *const __m512i) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let total = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    _mm512_reduce_add_epi64(total) as u64 + sum_words_portable(rounds.remainder())
}

/// Eight 32-byte loads per round into independent sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 8];
    let mut rounds = words.chunks_exact(32);
    for r in &mut rounds {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: the round holds 32 words, 4 per load.
            let v = unsafe { _mm256_loadu_si256(r.as_ptr().add(4 * i) as *const __m256i) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let mut lanes = [0u64; 4];
    for a in acc {
        let mut l = [0u64; 4];
        // SAFETY: `l` holds 4 words.
        unsafe { _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, a) };
        lanes
            .iter_mut()
            .zip(l)
            .for_each(|(s, v)| *s = s.wrapping_add(v));
    }
    lanes.iter().fold(0u64, |a, b| a.wrapping_add(*b)) + sum_words_portable(rounds.remainder())
}

/// Eight independent sums so the compiler vectorises the loop and no add chain limits it.
fn sum_words_portable(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for c in &mut chunks {
        for (l, w) in lanes.iter_mut().zip(c) {
            *l = l.wrapping_add(*w);
        }
    }
    lanes.iter().fold(0u64, |a, b| a.wrapping_add(*b)) + chunks.remainder().iter().sum::<u64>()
}

/// Peak f32 FMA rate of the detected ISA in GFLOP/s over all pool threads: independent FMA
/// chains in registers, no memory traffic (the ceiling for the f32-activation GEMM). Every pool
/// thread runs its chains at once (`rayon::broadcast`: one each, none left idle while another
/// runs two), and the best of three passes counts (the first also brings the cores up to
/// their clock).
pub fn fma_peak_gflops() -> f64 {
    const ITERS: usize = 20_000_000;
    (0..3)
        .map(|_| {
            let start = Instant::now();
            let flops: f64 = rayon::broadcast(|_| fma_chains(ITERS)).iter().sum();
            flops / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// FLOPs done by `iters` rounds of 12 independent FMAs of the ISA's width (16, 8 or 1 lanes).
fn fma_chains(iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    match super::isa() {
        super::Isa::Avx512 => {
            // SAFETY: AVX-512F was detected.
            unsafe { avx512_fma_chains(iters) };
            return (iters * 12 * 16 * 2) as f64;
        }
        super::Isa::Avx2 => {
            // SAFETY: AVX2 and FMA were detected.
            unsafe { avx2_fma_chains(iters) };
            return (iters * 12 * 8 * 2) as f64;
        }
        super::Isa::Scalar => {}
    }
    let mut acc = [0.0f32; 12];
    for _ in 0..iters {
        for a in &mut acc {
            *a = a.mul_add(0.999_999, 1e-9);
        }
    }
    std::hint::black_box(acc);
    (iters * 12 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_fma_chains(iters: usize) {
    use std::arch::x86_64::*;
    // Opaque operands and a used result keep the chains from being folded away.
    let b = std::hint::black_box(_mm512_set1_ps(0.999_999));
    let c = std::hint::black_box(_mm512_set1_ps(1e-9));
    let mut acc = [_mm512_setzero_ps(); 12];
    for _ in 0..iters {
        for a in &mut acc {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    std::hint::black_box(acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_fma_chains(iters: usize) {
    use std::arch::x86_64::*;
    let b = std::hint::black_box(_mm256_set1_ps(0.999_999));
    let c = std::hint::black_box(_mm256_set1_ps(1e-9));
    let mut acc = [_mm256_setzero_ps(); 12];
    for _ in 0..iters {
        for a in &mut acc {
            *a = _mm256_fmadd_ps(*a, b, c);
        }
    }
    std::hint::black_box(acc);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_exact_whatever_the_length() {
        for n in [0u64, 7, 32, 100, 1000] {
            let words: Vec<u64> = (1..=n).collect();
            assert_eq!(sum_words(&words), n * (n + 1) / 2, "{n} words");
        }
    }

    #[test]
    fn probes_measure_something() {
        assert!(read_bandwidth_gbps(16 << 20, 1) > 0.0);
        assert!(fma_peak_gflops() > 0.0);
    }
}
