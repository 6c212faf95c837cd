//! Every kernel of the top-level `cuda/` folder compiles to PTX for sm_80 (A100) and sm_90
//! (H100 / H200) through NVRTC 13.0, and defines the entry points the launch wrappers name. No
//! GPU is needed: CI gets NVRTC from NVIDIA's PyPI wheels (`scripts/fetch-nvrtc.sh`).
//!
//! NVRTC is required: a missing library fails these tests (set `MOESERVE_REQUIRE_NVRTC=0` to
//! skip them on a machine without it; CI sets 1).
#![cfg(feature = "cuda")]

use moeserve_backend::cuda::kernels::{self, KernelFile};
use moeserve_backend::cuda::nvrtc;

/// The architectures CI compiles for: PTX for compute_80 and compute_90, which the driver turns
/// into sm_80 / sm_90 code at load.
const ARCHES: [&str; 2] = ["compute_80", "compute_90"];

/// The include directory, or `None` when NVRTC may be skipped and is missing.
fn nvrtc_setup() -> Option<std::path::PathBuf> {
    let skip_allowed = std::env::var("MOESERVE_REQUIRE_NVRTC").is_ok_and(|v| v == "0");
    let setup = nvrtc::nvrtc_version().and_then(|_| nvrtc::cuda_include_dir());
    match setup {
        Ok(dir) => Some(dir),
        Err(e) if skip_allowed => {
            eprintln!("skipped (MOESERVE_REQUIRE_NVRTC=0): {e}");
            None
        }
        Err(e) => panic!(
            "NVRTC is required for this test: {e}\nrun scripts/test-cuda.sh (it fetches NVRTC \
             13.0 into target/cuda-nvrtc), or set MOESERVE_REQUIRE_NVRTC=0 to skip"
        ),
    }
}

#[test]
fn nvrtc_is_version_13_0() {
    if nvrtc_setup().is_none() {
        return;
    }
    // A newer NVRTC emits PTX that the H200's CUDA 13.0 driver rejects.
    assert_eq!(nvrtc::nvrtc_version().unwrap(), (13, 0));
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_with_its_entry_points() {
    let Some(include) = nvrtc_setup() else {
        return;
    };
    let mut failures = Vec::new();
    for file in KernelFile::ALL {
        for arch in ARCHES {
            match nvrtc::compile(file, arch, &include) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    for entry in file.entry_points() {
                        if !text.contains(&format!(".entry {entry}(")) {
                            failures
                                .push(format!("{}: no entry {entry} for {arch}", file.file_name()));
                        }
                    }
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_cu_file_in_the_cuda_folder_is_built_in() {
    // Found at run time: on the GPU machine the checkout is not where this was built.
    let dir = kernels::sources_dir();
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (set MOESERVE_CUDA_SOURCES)", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".cu"))
        .collect();
    on_disk.sort();
    let mut built_in: Vec<String> = KernelFile::ALL
        .iter()
        .map(|f| f.file_name().to_string())
        .collect();
    built_in.sort();
    assert_eq!(on_disk, built_in, "cuda/*.cu and KernelFile::ALL differ");
}
