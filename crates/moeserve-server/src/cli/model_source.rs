//! `--model`: a local directory, or a Hugging Face hub id (`org/name`) found in the Hugging Face
//! cache or downloaded into it through `hf-hub`, as vLLM does.
//!
//! The cache is the one `huggingface_hub` writes (`models--org--name/{blobs,snapshots/<commit>,
//! refs/<revision>}`), found as it finds it: `--download-dir`, else `HF_HUB_CACHE`, else
//! `HF_HOME/hub`, else `~/.cache/huggingface/hub`. A revision whose snapshot already holds the
//! files the engine reads loads from there without any network; `HF_HUB_OFFLINE=1` never uses
//! the network. Otherwise only those files are downloaded (config, generation config,
//! tokenizer, chat template, the safetensors shards of the index), each resumable, with a
//! progress bar; `HF_TOKEN` (or the token `huggingface-cli login` saved) authenticates and
//! `HF_ENDPOINT` names another hub.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

/// Files the engine reads when they exist, besides the weights.
const MODEL_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// Where the model's files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDir {
    pub dir: PathBuf,
    /// The hub id, when the model came from the hub.
    pub hub_id: Option<String>,
}

/// Whether `text` can only be a hub id (`name` or `org/name` of letters, digits, `-`, `_`, `.`),
/// when no directory of that name exists.
pub fn is_hub_id(text: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let mut parts = text.split('/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(name), None, None) => part(name),
        (Some(org), Some(name), None) => part(org) && part(name),
        _ => false,
    }
}

/// The hub cache directory: `download_dir`, else as `huggingface_hub` finds it.
pub fn cache_dir(download_dir: Option<&Path>) -> PathBuf {
    if let Some(dir) = download_dir {
        return dir.to_path_buf();
    }
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("HF_HUB_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(home) = var("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    Cache::default().path().clone()
}

/// `HF_HUB_OFFLINE` as `huggingface_hub` reads it.
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// Finds `model` as a directory, or as a hub id in the cache (downloading what is missing
/// unless offline).
pub fn resolve(
    model: &Path,
    revision: &str,
    download_dir: Option<&Path>,
) -> anyhow::Result<ModelDir> {
    let text = model.to_string_lossy();
    if model.is_dir() || !is_hub_id(&text) {
        return Ok(ModelDir {
            dir: model.to_path_buf(),
            hub_id: None,
        });
    }
    let id = text.into_owned();
    let cache = cache_dir(download_dir);
    if let Some(dir) = cached_snapshot(&cache, &id, revision) {
        tracing::info!("{id}: from the Hugging Face cache, {}", dir.display());
        return Ok(ModelDir {
            dir,
            hub_id: Some(id),
        });
    }
    if offline() {
        anyhow::bail!(
            "{id} (revision {revision}) is not a local directory, and HF_HUB_OFFLINE is set but \
             the Hugging Face cache {} holds no complete snapshot of it: download it first \
             (without HF_HUB_OFFLINE), or pass --download-dir with the cache that has it",
            cache.display()
        );
    }
    let dir = download(&cache, &id, revision)?;
    Ok(ModelDir {
        dir,
        hub_id: Some(id),
    })
}

fn repo(id: &str, revision: &str) -> Repo {
    Repo::with_revision(id.to_string(), RepoType::Model, revision.to_string())
}

/// The snapshot of `revision` (a branch or tag in `refs/`, or a commit) if it holds the config
/// and every weight file.
pub fn cached_snapshot(cache: &Path, id: &str, revision: &str) -> Option<PathBuf> {
    let cached = Cache::new(cache.to_path_buf()).repo(repo(id, revision));
    let dir = match cached.get("config.json") {
        Some(config) => config.parent()?.to_path_buf(),
        // A commit hash has no ref: its snapshot is named after it.
        None => {
            let folder = repo(id, revision).folder_name();
            let dir = cache.join(folder).join("snapshots").join(revision);
            dir.join("config.json").is_file().then_some(dir)?
        }
    };
    let weights = weight_files(&dir)?;
    weights.iter().all(|w| dir.join(w).is_file()).then_some(dir)
}

/// The safetensors files a snapshot needs: its index and the index's shards, or the single
/// file; `None` when it has neither.
fn weight_files(dir: &Path) -> Option<Vec<String>> {
    if dir.join(INDEX).is_file() {
        return shards_of(&dir.join(INDEX)).ok();
    }
    dir.join(SINGLE).is_file().then(|| vec![SINGLE.to_string()])
}

/// The shard names of a `model.safetensors.index.json` (its `weight_map` values, sorted).
fn shards_of(index: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(index)?;
    let value: serde_json::Value = serde_json::from_str(&text)?;
    let map = value["weight_map"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("{}: no weight_map", index.display()))?;
    let mut shards: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    shards.sort();
    shards.dedup();
    shards.insert(0, INDEX.to_string());
    Ok(shards)
}

/// Downloads the files the engine needs into the cache and returns the snapshot directory.
fn download(cache: &Path, id: &str, revision: &str) -> anyhow::Result<PathBuf> {
    let mut api = ApiBuilder::from_cache(Cache::new(cache.to_path_buf())).with_progress(true);
    if let Some(endpoint) = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()) {
        api = api.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        api = api.with_token(Some(token));
    }
    let api = api.build()?;
    let hub = api.repo(repo(id, revision));
    let context = |what: &str| format!("{id} (revision {revision}): {what}");
    let info = hub.info().map_err(|e| {
        anyhow::anyhow!(
            "{}: {e} (not a local directory either; the cache searched was {})",
            context("cannot list the repository on the hub"),
            cache.display()
        )
    })?;
    let listed: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let weights = if listed.contains(&INDEX) {
        let index = hub
            .get(INDEX)
            .map_err(|e| anyhow::anyhow!("{}: {e}", context(INDEX)))?;
        shards_of(&index)?
    } else if listed.contains(&SINGLE) {
        vec![SINGLE.to_string()]
    } else {
        anyhow::bail!("{}", context("the repository has no safetensors weights"));
    };
    let wanted = MODEL_FILES
        .iter()
        .filter(|f| listed.contains(f))
        .map(|f| f.to_string())
        .chain(weights);
    let mut config = None;
    for file in wanted {
        tracing::info!("{id}: fetching {file}");
        let path = hub
            .get(&file)
            .map_err(|e| anyhow::anyhow!("{}: {e}", context(&format!("downloading {file}"))))?;
        if file == "config.json" {
            config = Some(path);
        }
    }
    let config = config.ok_or_else(|| anyhow::anyhow!("{}", context("no config.json")))?;
    let dir = config
        .parent()
        .expect("a cached file lies in its snapshot directory")
        .to_path_buf();
    tracing::info!("{id}: downloaded to {}", dir.display());
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_told_from_paths() {
        for id in ["Qwen/Qwen3-30B-A3B", "gpt2", "org/name.v1_2"] {
            assert!(is_hub_id(id), "{id}");
        }
        for path in [
            "/models/x",
            "./x",
            "models/a/b",
            "..",
            "org/",
            "a b/c",
            "~/m",
        ] {
            assert!(!is_hub_id(path), "{path}");
        }
    }

    /// A snapshot in `huggingface_hub`'s layout: blobs named by their hash, the snapshot's
    /// files links to them, `refs/main` naming the commit.
    fn hub_layout(cache: &Path, id: &str, files: &[(&str, &str)]) -> PathBuf {
        let repo_dir = cache.join(format!("models--{}", id.replace('/', "--")));
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snapshot = repo_dir.join("snapshots").join(commit);
        std::fs::create_dir_all(repo_dir.join("blobs")).unwrap();
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::write(repo_dir.join("refs/main"), commit).unwrap();
        for (i, (name, text)) in files.iter().enumerate() {
            let blob = repo_dir.join("blobs").join(format!("{i:040x}"));
            std::fs::write(&blob, text).unwrap();
            std::os::unix::fs::symlink(&blob, snapshot.join(name)).unwrap();
        }
        snapshot
    }

    #[test]
    fn a_complete_snapshot_is_found_by_branch_and_by_commit() {
        let cache = tempfile::tempdir().unwrap();
        let index = r#"{"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00002-of-00002.safetensors"}}"#;
        let files = [
            ("config.json", "{}"),
            (INDEX, index),
            ("model-00001-of-00002.safetensors", ""),
        ];
        let snapshot = hub_layout(cache.path(), "org/tiny", &files);
        // A shard is missing: not complete.
        assert_eq!(cached_snapshot(cache.path(), "org/tiny", "main"), None);
        std::fs::write(snapshot.join("model-00002-of-00002.safetensors"), "").unwrap();
        assert_eq!(
            cached_snapshot(cache.path(), "org/tiny", "main"),
            Some(snapshot.clone())
        );
        let commit = snapshot.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            cached_snapshot(cache.path(), "org/tiny", commit),
            Some(snapshot)
        );
        assert_eq!(cached_snapshot(cache.path(), "org/tiny", "v2"), None);
        assert_eq!(cached_snapshot(cache.path(), "org/other", "main"), None);
    }

    #[test]
    fn a_local_directory_wins_over_a_hub_id() {
        let dir = tempfile::tempdir().unwrap();
        let found = resolve(dir.path(), "main", None).unwrap();
        assert_eq!(
            found,
            ModelDir {
                dir: dir.path().to_path_buf(),
                hub_id: None
            }
        );
    }
}
