//! Writes Hugging Face-format checkpoint directories: `config.json`, the tensors as one
//! `model.safetensors` or as `model-0000i-of-0000N.safetensors` shards with a
//! `model.safetensors.index.json`, and small side files (generation config, tokenizer).
//!
//! Follows transformers' `save_pretrained` layout (5-digit shard numbers, index with
//! `metadata.total_size` and `weight_map`). Tensors are produced lazily, one at a time, while the
//! file is written (the safetensors crate calls `View::data` per tensor), so a checkpoint far
//! larger than memory can be written; f32 values are rounded to the target dtype
//! round-to-nearest-even (the `half` crate, as torch's `.to(bfloat16)`).

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use moeserve_core::DType;
use safetensors::{Dtype, View};
use serde_json::{Value, json};

use crate::{FormatError, Result};

/// Produces a tensor's values (row-major, f32) into a buffer of exactly its element count.
pub type FillFn = Box<dyn Fn(&mut [f32]) -> Result<()> + Send + Sync>;

/// One tensor to write: what it is called and how to make its values when its turn comes.
pub struct TensorSource {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub fill: FillFn,
}

impl TensorSource {
    pub fn new(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        fill: impl Fn(&mut [f32]) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        TensorSource {
            name: name.into(),
            dtype,
            shape,
            fill: Box::new(fill),
        }
    }

    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn byte_size(&self) -> usize {
        match self.dtype {
            DType::Mxfp4 => self.num_elements(),
            dtype => self.num_elements() * dtype.size_in_bytes(),
        }
    }
}

impl std::fmt::Debug for TensorSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorSource")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// How tensors are spread over safetensors files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardLayout {
    /// Everything in `model.safetensors`.
    SingleFile,
    /// Start a new shard when the next tensor would push the current one past this many bytes
    /// (as transformers' `max_shard_size`); a single shard is written as `model.safetensors`.
    MaxShardBytes(u64),
    /// Exactly this many shards (fewer if there are fewer tensors), of about equal size.
    Count(usize),
}

/// What [`CheckpointWriter::write_tensors`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenTensors {
    /// The safetensors files, in shard order.
    pub files: Vec<PathBuf>,
    pub num_tensors: usize,
    pub num_parameters: u64,
    /// Tensor data bytes (the index's `total_size`).
    pub total_bytes: u64,
}

/// A directory written under a temporary name beside its final one (`.NAME.partial`, same
/// parent, so the rename stays on one file system) and put in place only once complete: a run
/// killed half way leaves no directory under the final name that `serve` would load.
#[derive(Debug)]
pub struct StagedDir {
    staging: PathBuf,
    out: PathBuf,
}

impl StagedDir {
    /// Starts a fresh staging directory for `out` (removing one an earlier killed run left).
    pub fn new(out: impl Into<PathBuf>) -> Result<Self> {
        let out = out.into();
        let name = out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| FormatError::config(&out, "the output needs a directory name"))?;
        let staging = out.with_file_name(format!(".{name}.partial"));
        // Errors name the directory asked for, not its temporary name.
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| FormatError::io(&out, e))?;
        }
        std::fs::create_dir_all(&staging).map_err(|e| FormatError::io(&out, e))?;
        Ok(StagedDir { staging, out })
    }

    /// Where the files are written until [`StagedDir::commit`].
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// The final directory.
    pub fn out(&self) -> &Path {
        &self.out
    }

    /// `file` (written under the staging directory) at its final place.
    pub fn final_path(&self, file: &Path) -> PathBuf {
        match file.strip_prefix(&self.staging) {
            Ok(relative) => self.out.join(relative),
            Err(_) => file.to_path_buf(),
        }
    }

    /// Puts the complete directory in place, replacing what was at the final name.
    pub fn commit(self) -> Result<PathBuf> {
        if self.out.exists() {
            std::fs::remove_dir_all(&self.out).map_err(|e| FormatError::io(&self.out, e))?;
        }
        std::fs::rename(&self.staging, &self.out).map_err(|e| FormatError::io(&self.out, e))?;
        Ok(self.out)
    }
}

/// Writes the files of one checkpoint directory.
#[derive(Clone, Debug)]
pub struct CheckpointWriter {
    dir: PathBuf,
}

impl CheckpointWriter {
    /// Creates `dir` (and its parents) if needed.
    pub fn create(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| FormatError::io(&dir, e))?;
        Ok(CheckpointWriter { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `value` as pretty JSON with a trailing newline.
    pub fn write_json(&self, file_name: &str, value: &Value) -> Result<PathBuf> {
        let mut text = serde_json::to_string_pretty(value)
            .map_err(|e| FormatError::config(self.dir.join(file_name), e.to_string()))?;
        text.push('\n');
        self.write_text(file_name, &text)
    }

    pub fn write_text(&self, file_name: &str, text: &str) -> Result<PathBuf> {
        let path = self.dir.join(file_name);
        std::fs::write(&path, text).map_err(|e| FormatError::io(&path, e))?;
        Ok(path)
    }

    /// `config.json`.
    pub fn write_config(&self, config: &Value) -> Result<PathBuf> {
        self.write_json("config.json", config)
    }

    /// Writes all tensors, generating each one only while it is written. Replaces a stale
    /// single file or index left by an earlier checkpoint of the other layout.
    pub fn write_tensors(
        &self,
        tensors: Vec<TensorSource>,
        layout: ShardLayout,
    ) -> Result<WrittenTensors> {
        let mut seen = HashSet::new();
        if let Some(dup) = tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
            let message = format!("tensor `{}` is listed twice", dup.name);
            return Err(FormatError::Safetensors {
                path: self.dir.clone(),
                message,
            });
        }
        let groups = plan_shards(&tensors, layout);
        let file_names: Vec<String> = match groups.len() {
            1 => vec!["model.safetensors".to_string()],
            n => (1..=n)
                .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
                .collect(),
        };
        let stale = if groups.len() == 1 {
            "model.safetensors.index.json"
        } else {
            "model.safetensors"
        };
        remove_if_present(&self.dir.join(stale))?;

        let mut weight_map = BTreeMap::new();
        let mut files = Vec::with_capacity(groups.len());
        for (group, file_name) in groups.iter().zip(&file_names) {
            let path = self.dir.join(file_name);
            write_safetensors(&path, group.iter().map(|&i| &tensors[i]))?;
            for &i in group {
                weight_map.insert(tensors[i].name.clone(), Value::String(file_name.clone()));
            }
            files.push(path);
        }
        let total_bytes: u64 = tensors.iter().map(|t| t.byte_size() as u64).sum();
        if groups.len() > 1 {
            let index =
                json!({ "metadata": { "total_size": total_bytes }, "weight_map": weight_map });
            self.write_json("model.safetensors.index.json", &index)?;
        }
        Ok(WrittenTensors {
            files,
            num_tensors: tensors.len(),
            num_parameters: tensors.iter().map(|t| t.num_elements() as u64).sum(),
            total_bytes,
        })
    }
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(FormatError::io(path, e)),
        _ => Ok(()),
    }
}

/// Splits tensor indices, in order, into shards.
fn plan_shards(tensors: &[TensorSource], layout: ShardLayout) -> Vec<Vec<usize>> {
    let max_bytes = match layout {
        ShardLayout::SingleFile => u64::MAX,
        ShardLayout::MaxShardBytes(max) => max.max(1),
        ShardLayout::Count(n) => {
            let total: u64 = tensors.iter().map(|t| t.byte_size() as u64).sum();
            return split_evenly(tensors, total, n.clamp(1, tensors.len().max(1)));
        }
    };
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut current = 0u64;
    for (i, tensor) in tensors.iter().enumerate() {
        let size = tensor.byte_size() as u64;
        let last = groups.last_mut().expect("groups starts non-empty");
        if !last.is_empty() && current + size > max_bytes {
            groups.push(vec![i]);
            current = size;
        } else {
            last.push(i);
            current += size;
        }
    }
    groups
}

/// `n` contiguous groups, the k-th ending at the first tensor whose cumulative size reaches
/// k/n of the total; every group holds at least one tensor.
fn split_evenly(tensors: &[TensorSource], total: u64, n: usize) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut cumulative = 0u64;
    let mut group = 0;
    for (i, tensor) in tensors.iter().enumerate() {
        let left_after = tensors.len() - i - 1;
        groups[group].push(i);
        cumulative += tensor.byte_size() as u64;
        let target = total as u128 * (group as u128 + 1) / n as u128;
        let must_move = left_after == n - group - 1;
        if group + 1 < n && (cumulative as u128 >= target || must_move) {
            group += 1;
        }
    }
    groups.retain(|g| !g.is_empty());
    groups
}

fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F8E4M3 => Dtype::F8_E4M3,
        // Its `*_blocks` and `*_scales` tensors ([`encode`]).
        DType::Mxfp4 => Dtype::U8,
        // GPTQ's and AWQ's packed words.
        DType::Int4 => Dtype::I32,
    }
}

/// A tensor whose bytes are made when the safetensors writer asks for them. `View::data`
/// cannot fail, so the first fill error is kept aside and reported after the write.
struct LazyTensor<'a> {
    source: &'a TensorSource,
    error: &'a RefCell<Option<FormatError>>,
}

impl View for LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        safetensors_dtype(self.source.dtype)
    }

    fn shape(&self) -> &[usize] {
        &self.source.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let mut values = vec![0.0f32; self.source.num_elements()];
        if let Err(e) = (self.source.fill)(&mut values) {
            self.error.borrow_mut().get_or_insert(e);
            return Cow::Owned(vec![0; self.data_len()]);
        }
        Cow::Owned(encode(&values, self.source.dtype))
    }

    fn data_len(&self) -> usize {
        self.source.byte_size()
    }
}

fn write_safetensors<'a>(
    path: &Path,
    tensors: impl Iterator<Item = &'a TensorSource>,
) -> Result<()> {
    let error = RefCell::new(None);
    let views = tensors.map(|source| {
        (
            source.name.as_str(),
            LazyTensor {
                source,
                error: &error,
            },
        )
    });
    let written = safetensors::serialize_to_file(views, None, path);
    if let Some(e) = error.into_inner() {
        // The file holds zeros where the failed tensor should be: never leave it behind.
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    written.map_err(|e| FormatError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    make_world_readable(path)
}

/// The safetensors crate writes through a private (0600) temp file; checkpoints are shared data.
fn make_world_readable(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let readable = std::fs::Permissions::from_mode(0o644);
        std::fs::set_permissions(path, readable).map_err(|e| FormatError::io(path, e))?;
    }
    Ok(())
}

/// `1234567` → `"1.23 M"`: parameter counts in reports.
pub fn human_count(n: u64) -> String {
    scaled(n as f64, &["", " K", " M", " B", " T"])
}

/// `1234567` → `"1.23 MB"` (decimal units, as file sizes on the hub).
pub fn human_bytes(n: u64) -> String {
    scaled(n as f64, &[" B", " kB", " MB", " GB", " TB"])
}

fn scaled(mut value: f64, units: &[&str]) -> String {
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < units.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value}{}", units[0])
    } else {
        format!("{value:.2}{}", units[unit])
    }
}

/// Little-endian bytes of `values` in `dtype`, converted on all cores for big tensors. An
/// MXFP4 tensor is one of its u8 `*_blocks` or `*_scales` tensors: `values` are its bytes.
pub fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    let width = match dtype {
        DType::Mxfp4 => 1,
        DType::Int4 => unreachable!("int4 weights are not written from f32 values"),
        other => other.size_in_bytes(),
    };
    let mut out = vec![0u8; values.len() * width];
    const CHUNK: usize = 1 << 20;
    let encode_chunk = |src: &[f32], dst: &mut [u8]| match dtype {
        DType::F32 => {
            for (d, &v) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::BF16 => {
            for (d, &v) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        DType::F16 => {
            for (d, &v) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        // The values as they are (already divided by their block's scale).
        DType::F8E4M3 => {
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = moeserve_core::fp8::e4m3_from_f32(v);
            }
        }
        DType::Mxfp4 => {
            for (d, &v) in dst.iter_mut().zip(src) {
                debug_assert!((0.0..=255.0).contains(&v) && v.fract() == 0.0);
                *d = v as u8;
            }
        }
        DType::Int4 => unreachable!("int4 weights are not written from f32 values"),
    };
    if values.len() <= CHUNK {
        encode_chunk(values, &mut out);
        return out;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = values.len().div_ceil(threads).next_multiple_of(CHUNK);
    std::thread::scope(|scope| {
        for (src, dst) in values
            .chunks(per_thread)
            .zip(out.chunks_mut(per_thread * width))
        {
            scope.spawn(move || encode_chunk(src, dst));
        }
    });
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_staged_directory_appears_under_its_name_only_when_committed() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("old.txt"), "old").unwrap();
        let staged = super::StagedDir::new(&out).unwrap();
        std::fs::write(staged.path().join("config.json"), "{}").unwrap();
        // Not yet: the old directory is untouched, the new files are elsewhere.
        assert!(out.join("old.txt").exists() && !out.join("config.json").exists());
        let file = staged.final_path(&staged.path().join("config.json"));
        assert_eq!(file, out.join("config.json"));
        staged.commit().unwrap();
        assert!(out.join("config.json").exists() && !out.join("old.txt").exists());
        // A run killed before its commit leaves only the staging directory, which the next
        // run removes.
        let killed = super::StagedDir::new(&out).unwrap();
        std::fs::write(killed.path().join("half.safetensors"), "x").unwrap();
        drop(killed);
        let again = super::StagedDir::new(&out).unwrap();
        assert!(!again.path().join("half.safetensors").exists());
    }

    use super::*;

    fn constant(name: &str, shape: Vec<usize>, value: f32) -> TensorSource {
        TensorSource::new(name, DType::BF16, shape, move |out| {
            out.fill(value);
            Ok(())
        })
    }

    fn read_values(path: &Path, name: &str) -> (Vec<usize>, Dtype, Vec<u8>) {
        let bytes = std::fs::read(path).expect("read safetensors");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
        let view = file.tensor(name).expect("tensor present");
        (view.shape().to_vec(), view.dtype(), view.data().to_vec())
    }

    #[test]
    fn single_file_holds_every_tensor_in_its_dtype() {
        let dir = tempfile::tempdir().expect("temp dir");
        let writer = CheckpointWriter::create(dir.path().join("ckpt")).expect("create");
        let tensors = vec![
            constant("b", vec![2, 3], 1.5),
            TensorSource::new("a", DType::F32, vec![4], |out| {
                out.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
                Ok(())
            }),
        ];
        let written = writer
            .write_tensors(tensors, ShardLayout::SingleFile)
            .expect("write");
        assert_eq!(written.num_parameters, 10);
        assert_eq!(written.total_bytes, 6 * 2 + 4 * 4);
        let path = dir.path().join("ckpt/model.safetensors");
        assert_eq!(written.files, vec![path.clone()]);
        let (shape, dtype, data) = read_values(&path, "b");
        assert_eq!((shape, dtype), (vec![2, 3], Dtype::BF16));
        assert_eq!(&data[..2], &bf16::from_f32(1.5).to_le_bytes());
        let (_, dtype, data) = read_values(&path, "a");
        assert_eq!(dtype, Dtype::F32);
        assert_eq!(
            data,
            [1.0f32, 2.0, 3.0, 4.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn shards_get_hf_names_and_an_index() {
        let dir = tempfile::tempdir().expect("temp dir");
        let writer = CheckpointWriter::create(dir.path()).expect("create");
        let tensors = (0..5)
            .map(|i| constant(&format!("t{i}"), vec![8], i as f32))
            .collect();
        let written = writer
            .write_tensors(tensors, ShardLayout::Count(2))
            .expect("write");
        assert_eq!(written.files.len(), 2);
        assert!(dir.path().join("model-00001-of-00002.safetensors").exists());
        assert!(dir.path().join("model-00002-of-00002.safetensors").exists());
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("model.safetensors.index.json"))
                .expect("index"),
        )
        .expect("index json");
        assert_eq!(index["metadata"]["total_size"], 5 * 8 * 2);
        assert_eq!(index["weight_map"].as_object().map(|m| m.len()), Some(5));
        let shard = index["weight_map"]["t4"].as_str().expect("t4 mapped");
        let (_, _, data) = read_values(&dir.path().join(shard), "t4");
        assert_eq!(&data[..2], &bf16::from_f32(4.0).to_le_bytes());
    }

    #[test]
    fn max_shard_bytes_starts_a_new_file_when_full() {
        let tensors: Vec<_> = (0..4)
            .map(|i| constant(&format!("t{i}"), vec![10], 0.0))
            .collect();
        assert_eq!(
            plan_shards(&tensors, ShardLayout::MaxShardBytes(45)),
            vec![vec![0, 1], vec![2, 3]]
        );
        assert_eq!(
            plan_shards(&tensors, ShardLayout::MaxShardBytes(1)).len(),
            4
        );
        assert_eq!(plan_shards(&tensors, ShardLayout::Count(3)).len(), 3);
        assert_eq!(plan_shards(&tensors, ShardLayout::Count(9)).len(), 4);
    }

    #[test]
    fn a_failing_tensor_fails_the_write_and_leaves_no_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let writer = CheckpointWriter::create(dir.path()).expect("create");
        let failing = TensorSource::new("bad", DType::F32, vec![2], |_| {
            Err(FormatError::config("source.gguf", "cannot decode"))
        });
        let err = writer
            .write_tensors(
                vec![constant("ok", vec![2], 1.0), failing],
                ShardLayout::SingleFile,
            )
            .expect_err("fill error must surface");
        assert!(err.to_string().contains("cannot decode"), "{err}");
        assert!(!dir.path().join("model.safetensors").exists());
    }

    #[test]
    fn duplicate_names_are_rejected() {
        let dir = tempfile::tempdir().expect("temp dir");
        let writer = CheckpointWriter::create(dir.path()).expect("create");
        let tensors = vec![constant("x", vec![1], 0.0), constant("x", vec![1], 0.0)];
        let err = writer
            .write_tensors(tensors, ShardLayout::SingleFile)
            .expect_err("duplicate");
        assert!(err.to_string().contains("`x` is listed twice"), "{err}");
    }

    #[test]
    fn sizes_read_naturally() {
        assert_eq!(human_count(484_672), "484.67 K");
        assert_eq!(human_count(1_552_057_344), "1.55 B");
        assert_eq!(human_count(12), "12");
        assert_eq!(human_bytes(6_329_376_768), "6.33 GB");
        assert_eq!(human_bytes(969_344), "969.34 kB");
    }

    #[test]
    fn encoding_rounds_to_nearest_even_on_every_thread() {
        let values: Vec<f32> = (0..(3 << 20)).map(|i| 1.0 + i as f32 * 1e-7).collect();
        let bytes = encode(&values, DType::BF16);
        for i in [0, 1 << 20, (3 << 20) - 1] {
            let expected = bf16::from_f32(values[i]).to_le_bytes();
            assert_eq!(&bytes[2 * i..2 * i + 2], &expected);
        }
        // 1 + 2^-8 lies halfway between two bf16 values and rounds to the even one (1.0).
        assert_eq!(
            encode(&[1.0 + 1.0 / 256.0], DType::BF16),
            bf16::ONE.to_le_bytes()
        );
    }
}
