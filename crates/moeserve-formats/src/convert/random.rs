//! Seeded random tensors that are the same bytes on every machine and thread count.
//!
//! Each tensor gets its own ChaCha8 key derived from `(seed, tensor name)` (FNV-1a of the name
//! mixed with the seed by SplitMix64), and each 64 Ki-element chunk of it its own ChaCha
//! stream, so chunks are generated in parallel without changing a value. Normal samples use
//! the Irwin–Hall sum of four uniforms (mean 0, variance 1, tails cut at ±3.46): only integer
//! and exact float arithmetic, no libm `ln`/`sin` whose last bit may differ between platforms.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CHUNK: usize = 1 << 16;

/// A reproducible random source for one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorRng {
    key: [u8; 32],
}

impl TensorRng {
    pub fn new(seed: u64, tensor_name: &str) -> Self {
        let mut state = seed ^ fnv1a(tensor_name.as_bytes()).rotate_left(17);
        let mut key = [0u8; 32];
        for word in key.chunks_exact_mut(8) {
            word.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
        }
        TensorRng { key }
    }

    /// Fills `out` with `N(0, std²)`-like samples (see the module doc).
    pub fn fill_normal(&self, out: &mut [f32], std: f32) {
        self.fill_with(out, |rng, chunk| {
            for value in chunk {
                *value = standard_normal(rng.next_u64()) * std;
            }
        });
    }

    /// Fills `out` with uniform bytes `0..=255` (as f32): random MXFP4 blocks.
    pub fn fill_bytes(&self, out: &mut [f32]) {
        self.fill_with(out, |rng, chunk| {
            for value in chunk {
                *value = (rng.next_u32() >> 24) as f32;
            }
        });
    }

    /// Multiplies every element by `1 + scale · z`, `z` standard normal-like.
    pub fn jitter_multiplicative(&self, values: &mut [f32], scale: f32) {
        self.fill_with(values, |rng, chunk| {
            for value in chunk {
                *value *= 1.0 + scale * standard_normal(rng.next_u64());
            }
        });
    }

    /// Runs `fill` over 64 Ki-element chunks, chunk `c` with ChaCha stream `c`, on all cores.
    fn fill_with(&self, out: &mut [f32], fill: impl Fn(&mut ChaCha8Rng, &mut [f32]) + Sync) {
        let run = |first_chunk: usize, part: &mut [f32]| {
            for (c, chunk) in part.chunks_mut(CHUNK).enumerate() {
                let mut rng = ChaCha8Rng::from_seed(self.key);
                rng.set_stream((first_chunk + c) as u64);
                fill(&mut rng, chunk);
            }
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        if out.len() <= 4 * CHUNK || threads == 1 {
            run(0, out);
            return;
        }
        let chunks_per_thread = out.len().div_ceil(CHUNK).div_ceil(threads);
        std::thread::scope(|scope| {
            for (t, part) in out.chunks_mut(chunks_per_thread * CHUNK).enumerate() {
                let run = &run;
                scope.spawn(move || run(t * chunks_per_thread, part));
            }
        });
    }
}

/// Irwin–Hall: four 16-bit uniforms (centred in their cells) summed, centred and scaled to
/// unit variance (the sum of four U(0,1) has variance 1/3).
fn standard_normal(bits: u64) -> f32 {
    let sum: u32 = (0..4).map(|k| ((bits >> (16 * k)) & 0xFFFF) as u32).sum();
    // (sum + 2 - 4 · 32768) / 65536 is the centred sum of the four uniforms, exactly.
    let centred = (sum as f32 + 2.0 - 131_072.0) / 65_536.0;
    centred * 3.0f32.sqrt()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_name_give_the_same_values() {
        let mut a = vec![0.0; 1000];
        let mut b = vec![0.0; 1000];
        TensorRng::new(3, "w").fill_normal(&mut a, 1.0);
        TensorRng::new(3, "w").fill_normal(&mut b, 1.0);
        assert_eq!(a, b);
        TensorRng::new(4, "w").fill_normal(&mut b, 1.0);
        assert_ne!(a, b);
        TensorRng::new(3, "v").fill_normal(&mut b, 1.0);
        assert_ne!(a, b);
    }

    #[test]
    fn parallel_fill_equals_chunk_by_chunk_fill() {
        let rng = TensorRng::new(9, "big");
        let mut parallel = vec![0.0; 10 * CHUNK + 123];
        rng.fill_normal(&mut parallel, 0.5);
        let mut serial = vec![0.0; parallel.len()];
        rng.fill_with(&mut serial[..], |_, _| {});
        for (c, chunk) in serial.chunks_mut(CHUNK).enumerate() {
            let mut stream = ChaCha8Rng::from_seed(rng.key);
            stream.set_stream(c as u64);
            for v in chunk {
                *v = standard_normal(stream.next_u64()) * 0.5;
            }
        }
        assert_eq!(parallel, serial);
    }

    #[test]
    fn samples_have_zero_mean_and_requested_std() {
        let mut values = vec![0.0f32; 200_000];
        TensorRng::new(1, "stats").fill_normal(&mut values, 2.0);
        let n = values.len() as f64;
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = values
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.02, "std {}", var.sqrt());
        assert!(values.iter().all(|v| v.abs() <= 2.0 * 3.47));
    }
}
