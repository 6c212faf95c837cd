//! CPU kernels: a scalar reference (`reference`) and runtime-dispatched SIMD variants.
//!
//! The instruction set is detected once ([`isa`]) and logged by the caller; every kernel entry
//! point here dispatches on it. Tests compare each variant against `reference`.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod convert;
mod grouped;
mod matmul;
mod ops;
pub mod packed;
pub mod probe;
mod quant;
pub mod reference;

pub use grouped::{ExpertRows, grouped_swiglu};
pub use matmul::matmul_wt;
pub use ops::{add_assign, apply_rope, rms_norm, rope_inv_freq, silu_mul, softmax_in_place};
pub use quant::{WeightQuantization, set_weight_quantization, weight_quantization};

use std::sync::OnceLock;

/// Sizes the kernels' persistent thread pool: `threads`, or one per core. Call once, before
/// the first kernel runs; returns the pool's size.
pub fn init_threads(threads: Option<usize>) -> Result<usize, String> {
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        if n == 0 {
            return Err("--threads must be at least 1".into());
        }
        builder = builder.num_threads(n);
    }
    builder
        .build_global()
        .map_err(|e| format!("cannot start the kernel thread pool: {e}"))?;
    Ok(rayon::current_num_threads())
}

/// The widest instruction set the kernels use on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F (with BW): 16-lane f32 FMA, bf16 widened by shifts, f16 by `vcvtph2ps`.
    Avx512,
    /// Portable scalar code (auto-vectorised by the compiler for the baseline target).
    Scalar,
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isa::Avx512 => "avx512",
            Isa::Scalar => "scalar",
        })
    }
}

/// The instruction set chosen for this process (detected on first use).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(detect_isa)
}

fn detect_isa() -> Isa {
    if std::env::var("MOESERVE_ISA").is_ok_and(|v| v == "scalar") {
        return Isa::Scalar;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            return Isa::Avx512;
        }
    }
    Isa::Scalar
}
