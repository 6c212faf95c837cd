//! CPU kernels: a scalar reference (`reference`) and runtime-dispatched SIMD variants.
//!
//! The instruction set is detected once ([`isa`]) and logged by the caller; every kernel entry
//! point here dispatches on it. Tests compare each variant against `reference`.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod convert;
mod exp;
pub mod fp8;
mod grids;
mod grouped;
pub mod int4;
pub mod int8;
pub mod intdot;
mod matmul;
pub mod mxfp4;
mod ops;
pub mod packed;
pub mod probe;
pub mod quant;
pub mod reference;

pub use grouped::{
    ExpertBias, ExpertGroup, ExpertRows, GroupedScratch, grouped_swiglu, grouped_swiglu_in,
};
pub use matmul::{matmul_wt, matmul_wt_in, matmul_wt_many};
pub use ops::{
    GatedActivation, RopeAngles, add_assign, add_bias, add_rms_norm, apply_rope,
    apply_rope_interleaved, log_sum_exp, rms_norm, rms_norm_in_place, rope_inv_freq, silu_mul,
    softmax_in_place,
};
pub use quant::{WeightQuantization, set_weight_quantization, weight_quantization};

use std::sync::OnceLock;

/// Sizes every kernel thread's per-task buffers for products of up to `max_rows` activation
/// rows (a step's token budget), so the steps after it allocate nothing in the kernels' tasks
/// whichever thread runs them. Runs on every thread of the current pool.
pub fn reserve_task_scratch(max_rows: usize) {
    rayon::broadcast(|_| {
        matmul::reserve_task_scratch(max_rows);
        grouped::reserve_task_scratch(max_rows);
        int4::reserve_task_scratch();
    });
}

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
    /// AVX2 + FMA + F16C: the same kernels 8 lanes wide; the GEMMs give the same bits as
    /// AVX-512, attention (reduced 8 lanes wide, not 16) differs in the last bits.
    Avx2,
    /// Portable scalar code (auto-vectorised by the compiler for the baseline target).
    Scalar,
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Scalar => "scalar",
        })
    }
}

/// The instruction set chosen for this process (detected on first use).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(detect_isa)
}

/// The widest supported ISA, or a narrower one named by `MOESERVE_ISA` (`avx2`, `scalar`; for
/// tests and comparisons; a wider one than the CPU has is not taken).
fn detect_isa() -> Isa {
    let wanted = std::env::var("MOESERVE_ISA").unwrap_or_default();
    if wanted == "scalar" {
        return Isa::Scalar;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && wanted != "avx2" {
            return Isa::Avx512;
        }
        if has!("avx2") && has!("fma") && has!("f16c") {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

impl Isa {
    /// Whether matmuls run on panel-packed weights (`packed.rs`), which the model then packs at
    /// load.
    pub fn packs_weights(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx2)
    }
}
