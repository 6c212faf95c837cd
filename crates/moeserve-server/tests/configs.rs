//! The example serve configs in configs/ stay loadable as the flags evolve.

use std::path::Path;

use moeserve_server::cli::serve;
use moeserve_server::config_file;

#[test]
fn every_example_serve_config_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !(name.starts_with("serve-") && name.ends_with(".toml")) {
            continue;
        }
        let args = config_file::file_args(&serve::command(), &path, |_| false)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(args.iter().any(|a| a == "--model"), "{name} names a model");
        assert!(
            !args.iter().any(|a| a == "--api-key"),
            "{name} keeps keys out of files"
        );
        checked += 1;
    }
    assert!(
        checked >= 2,
        "found {checked} serve configs in {}",
        dir.display()
    );
}

#[test]
fn the_kubernetes_serve_config_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes/serve.toml");
    let args = config_file::file_args(&serve::command(), &path, |_| false)
        .unwrap_or_else(|e| panic!("{e}"));
    let model = args
        .iter()
        .position(|a| a == "--model")
        .expect("names a model");
    assert_eq!(args[model + 1], "Qwen/Qwen3-30B-A3B");
    assert!(args.iter().any(|a| a == "--shutdown-timeout"));
}
