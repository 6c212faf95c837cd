//! The `.cu` files of the top-level `cuda/` folder, built into the binary (a deployed
//! `moeserve` carries its kernel sources and compiles them for the device at start-up), and the
//! entry points each one must define.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// `cuda/common.cuh`, prepended to every source before NVRTC compiles it.
pub const COMMON: &str = include_str!("../../../../cuda/common.cuh");

/// One kernel source file of `cuda/`, an op family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelFile {
    Embedding,
    RmsNorm,
    Rope,
    KvCache,
    PagedAttention,
    MoeRouter,
    MoePermute,
    SwiGlu,
    Sampling,
    Init,
    Elementwise,
    Mla,
    MoeGemm,
}

impl KernelFile {
    pub const ALL: [KernelFile; 13] = [
        KernelFile::Embedding,
        KernelFile::RmsNorm,
        KernelFile::Rope,
        KernelFile::KvCache,
        KernelFile::PagedAttention,
        KernelFile::MoeRouter,
        KernelFile::MoePermute,
        KernelFile::SwiGlu,
        KernelFile::Sampling,
        KernelFile::Init,
        KernelFile::Elementwise,
        KernelFile::Mla,
        KernelFile::MoeGemm,
    ];

    /// The file name under `cuda/`.
    pub fn file_name(self) -> &'static str {
        match self {
            KernelFile::Embedding => "embedding.cu",
            KernelFile::RmsNorm => "rmsnorm.cu",
            KernelFile::Rope => "rope.cu",
            KernelFile::KvCache => "kv_cache.cu",
            KernelFile::PagedAttention => "paged_attention.cu",
            KernelFile::MoeRouter => "moe_router.cu",
            KernelFile::MoePermute => "moe_permute.cu",
            KernelFile::SwiGlu => "swiglu.cu",
            KernelFile::Sampling => "sampling.cu",
            KernelFile::Init => "init.cu",
            KernelFile::Elementwise => "elementwise.cu",
            KernelFile::Mla => "mla.cu",
            KernelFile::MoeGemm => "moe_gemm.cu",
        }
    }

    /// The file's text (without `common.cuh`).
    pub fn source(self) -> &'static str {
        match self {
            KernelFile::Embedding => include_str!("../../../../cuda/embedding.cu"),
            KernelFile::RmsNorm => include_str!("../../../../cuda/rmsnorm.cu"),
            KernelFile::Rope => include_str!("../../../../cuda/rope.cu"),
            KernelFile::KvCache => include_str!("../../../../cuda/kv_cache.cu"),
            KernelFile::PagedAttention => include_str!("../../../../cuda/paged_attention.cu"),
            KernelFile::MoeRouter => include_str!("../../../../cuda/moe_router.cu"),
            KernelFile::MoePermute => include_str!("../../../../cuda/moe_permute.cu"),
            KernelFile::SwiGlu => include_str!("../../../../cuda/swiglu.cu"),
            KernelFile::Sampling => include_str!("../../../../cuda/sampling.cu"),
            KernelFile::Init => include_str!("../../../../cuda/init.cu"),
            KernelFile::Elementwise => include_str!("../../../../cuda/elementwise.cu"),
            KernelFile::Mla => include_str!("../../../../cuda/mla.cu"),
            KernelFile::MoeGemm => include_str!("../../../../cuda/moe_gemm.cu"),
        }
    }

    /// Kernels instantiated per element type: `{name}_f32`, `{name}_f16`, `{name}_bf16`.
    pub fn typed_kernels(self) -> &'static [&'static str] {
        match self {
            KernelFile::Embedding => &["embedding"],
            KernelFile::RmsNorm => &["rms_norm_residual", "rms_norm_rows"],
            KernelFile::Rope => &["rope"],
            KernelFile::KvCache => &["write_kv"],
            KernelFile::PagedAttention => &["paged_attention", "paged_attention_reduce"],
            KernelFile::MoeRouter => &["route_top_k"],
            KernelFile::MoePermute => &["moe_permute", "moe_unpermute"],
            KernelFile::SwiGlu => &["silu_mul", "clamped_swiglu"],
            KernelFile::Sampling => &["argmax_logprob"],
            KernelFile::Init => &["fill_uniform"],
            KernelFile::Elementwise => &["add_bias", "add_segment_bias", "clamp", "add_gated"],
            KernelFile::Mla => &["mla_rope", "mla_copy_rope", "write_latent"],
            KernelFile::MoeGemm => &["moe_grouped_gemm"],
        }
    }

    /// Kernels with a single instantiation.
    pub fn untyped_kernels(self) -> &'static [&'static str] {
        match self {
            KernelFile::Embedding => &["gather_rows_f32"],
            KernelFile::MoePermute => &["moe_segment_offsets"],
            _ => &[],
        }
    }

    /// Every `extern "C"` entry point the file must define.
    pub fn entry_points(self) -> Vec<String> {
        let typed = self
            .typed_kernels()
            .iter()
            .flat_map(|name| ["f32", "f16", "bf16"].map(|suffix| format!("{name}_{suffix}")));
        typed
            .chain(self.untyped_kernels().iter().map(|s| s.to_string()))
            .collect()
    }

    /// What NVRTC compiles: `common.cuh`, then the file, with a `#line` so errors name the file
    /// and its own line numbers.
    pub fn program(self) -> String {
        format!(
            "{COMMON}\n#line 1 \"{}\"\n{}",
            self.file_name(),
            self.source()
        )
    }
}

/// The `cuda/` folder of this checkout, found at run time: `$MOESERVE_CUDA_SOURCES` when set
/// (`bench/gpu_check.sh` sets it: test binaries built on one machine run from another checkout
/// on the GPU machine), else the folder next to the crate this was built from. The binary
/// itself never reads it (the sources are built in); the tests that compare the two do.
pub fn sources_dir() -> PathBuf {
    sources_dir_from(std::env::var_os(SOURCES_ENV))
}

/// The variable [`sources_dir`] reads.
pub const SOURCES_ENV: &str = "MOESERVE_CUDA_SOURCES";

fn sources_dir_from(var: Option<OsString>) -> PathBuf {
    match var {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cuda"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sources_are_where_the_variable_says_else_beside_the_build() {
        assert_eq!(
            sources_dir_from(Some("/elsewhere/cuda".into())),
            PathBuf::from("/elsewhere/cuda")
        );
        for unset in [None, Some(OsString::new())] {
            let dir = sources_dir_from(unset);
            assert!(dir.ends_with("../../cuda"), "{}", dir.display());
            assert!(dir.join("common.cuh").is_file(), "{}", dir.display());
        }
    }
}
