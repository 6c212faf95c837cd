//! Safetensors files through the loader the server uses: the bytes are written as
//! `model.safetensors` in a scratch directory and opened with `Checkpoint::open`, then every
//! tensor is taken with the shape its header gives. A corrupted file must be an error, never a
//! panic or a read outside the file.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use moeserve_model::checkpoint::Checkpoint;

fn scratch_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("moeserve-fuzz-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = scratch_dir();
    std::fs::write(dir.join("model.safetensors"), data).expect("write the input");
    let Ok(checkpoint) = Checkpoint::open(dir) else {
        return;
    };
    let names: Vec<String> = checkpoint.tensor_names().map(str::to_string).collect();
    for name in names {
        let shape = checkpoint.tensor_shape(&name).expect("listed").to_vec();
        if let Ok(weight) = checkpoint.weight(&name, &shape) {
            // Touch the first and last byte: the range must lie inside the file.
            let bytes = weight.as_bytes();
            std::hint::black_box((bytes.first(), bytes.last()));
        }
    }
});
