//! GGUF files through the reader `make-model --from-gguf` uses: the bytes are written to a
//! scratch file and opened with `GgufFile::open`; then every tensor's bytes are taken, and the
//! small ones dequantised. A corrupted file must be an error, never a panic, a huge allocation
//! or a read outside the file.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use moeserve_formats::gguf::GgufFile;

fn scratch_file() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        std::env::temp_dir().join(format!("moeserve-fuzz-{}.gguf", std::process::id()))
    })
}

/// Dequantising is linear in the elements: keep each run fast.
const MAX_DEQUANTISED_ELEMENTS: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let path = scratch_file();
    std::fs::write(path, data).expect("write the input");
    let Ok(file) = GgufFile::open(path) else {
        return;
    };
    for (key, _) in file.metadata() {
        std::hint::black_box(file.get(key));
    }
    std::hint::black_box(file.opt_str("general.architecture").ok());
    let tensors = file.tensors().to_vec();
    for tensor in tensors {
        if let Ok(bytes) = file.tensor_bytes(&tensor.name) {
            std::hint::black_box((bytes.first(), bytes.last()));
        }
        if tensor.num_elements() <= MAX_DEQUANTISED_ELEMENTS {
            std::hint::black_box(file.tensor_f32(&tensor.name).ok());
        }
    }
});
