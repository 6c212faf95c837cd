//! GGUF files: a memory-mapped reader with typed metadata access and f32 dequantisation of
//! tensors, plus a small writer used to make test files.
//!
//! Follows the GGUF spec (ggml `docs/gguf.md`, versions 2 and 3) and gguf-py's reader:
//! tensor shapes are reported row-major as numpy shows them (ggml's `ne` reversed), and
//! `tensor_f32` returns the same values as `gguf.quants.dequantize`.

mod parse;
pub mod quant;
mod value;
mod write;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{FormatError, Result};
pub use parse::GgufTensorInfo;
pub use quant::{GgmlType, dequantize, dequantize_into};
pub use value::GgufValue;
pub use write::GgufBuilder;

/// An open GGUF file: parsed header over a read-only memory map of the whole file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`. A truncated or malformed file is an error naming the file and
    /// the first thing found wrong.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| FormatError::io(&path, e))?;
        // SAFETY: the map is read-only and private to this value. Like every mmap reader we
        // rely on the file not being truncated by another process while it is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(&path, e))?;
        let header = parse::parse_header(&mmap).map_err(|message| gguf_error(&path, message))?;
        let metadata_index = header
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (key, _))| (key.clone(), i))
            .collect();
        let tensor_index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path,
            mmap,
            version: header.version,
            metadata: header.metadata,
            metadata_index,
            tensors: header.tensors,
            tensor_index,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment`, 32 when absent.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of `key` converted by `convert`; `None` when the key is absent, an error
    /// naming the key, file and both types when it holds something else.
    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        convert: impl FnOnce(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        match convert(value) {
            Some(v) => Ok(Some(v)),
            None => Err(gguf_error(
                &self.path,
                format!(
                    "metadata `{key}` should be {expected}, found {} {}",
                    value.type_name(),
                    brief(value)
                ),
            )),
        }
    }

    fn required<T>(&self, key: &str, value: Option<T>) -> Result<T> {
        value.ok_or_else(|| gguf_error(&self.path, format!("missing metadata key `{key}`")))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", GgufValue::as_str)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let value = self.opt_str(key)?;
        self.required(key, value)
    }

    /// A non-negative integer of any width.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", |v| {
            v.as_integer().and_then(|i| u64::try_from(i).ok())
        })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let value = self.opt_u64(key)?;
        self.required(key, value)
    }

    /// A non-negative integer that fits in `usize`.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let value = self.get_u64(key)?;
        usize::try_from(value).map_err(|_| {
            gguf_error(
                &self.path,
                format!("metadata `{key}` = {value} is too large"),
            )
        })
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(_) => self.get_usize(key).map(Some),
        }
    }

    /// A float or integer of any width.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", GgufValue::as_f64)
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let value = self.opt_f64(key)?;
        self.required(key, value)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", GgufValue::as_bool)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let value = self.opt_bool(key)?;
        self.required(key, value)
    }

    pub fn get_array(&self, key: &str) -> Result<&[GgufValue]> {
        let value = self.typed(key, "an array", GgufValue::as_array)?;
        self.required(key, value)
    }

    /// An array of strings, e.g. `tokenizer.ggml.tokens`.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let value = self.typed(key, "an array of strings", |v| {
            v.as_array()?
                .iter()
                .map(GgufValue::as_str)
                .collect::<Option<Vec<_>>>()
        })?;
        self.required(key, value)
    }

    /// An array of integers of any width, e.g. `tokenizer.ggml.token_type`.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>> {
        let value = self.typed(key, "an array of integers", |v| {
            v.as_array()?
                .iter()
                .map(|item| item.as_integer().and_then(|i| i64::try_from(i).ok()))
                .collect::<Option<Vec<_>>>()
        })?;
        self.required(key, value)
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo> {
        match self.tensor_index.get(name) {
            Some(&i) => Ok(&self.tensors[i]),
            None => Err(FormatError::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            }),
        }
    }

    /// The raw (possibly quantised) bytes of a tensor.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor_info(name)?;
        let size = info.byte_size().ok_or_else(|| {
            gguf_error(
                &self.path,
                format!(
                    "tensor `{name}` has {}, whose size is unknown",
                    info.ggml_type
                ),
            )
        })?;
        let start = self.data_offset + info.offset;
        // Bounds were checked against the file length when it was parsed.
        Ok(&self.mmap[start..start + size])
    }

    /// Dequantises a tensor into `out`, which must hold exactly its element count.
    pub fn tensor_f32_into(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let info = self.dequantizable(name)?;
        if out.len() != info.num_elements() {
            return Err(gguf_error(
                &self.path,
                format!(
                    "tensor `{name}` has {} elements, buffer holds {}",
                    info.num_elements(),
                    out.len()
                ),
            ));
        }
        let bytes = self.tensor_bytes(name)?;
        dequantize_into(info.ggml_type, bytes, out)
            .map_err(|e| gguf_error(&self.path, format!("tensor `{name}`: {e}")))
    }

    /// A tensor's values in row-major order (shape as [`GgufTensorInfo::shape`]).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        // Checked before allocating: a known type's size was bounded by the file length.
        let mut out = vec![0.0f32; self.dequantizable(name)?.num_elements()];
        self.tensor_f32_into(name, &mut out)?;
        Ok(out)
    }

    /// The info of a tensor whose type [`tensor_f32`](Self::tensor_f32) can decode.
    pub fn dequantizable(&self, name: &str) -> Result<&GgufTensorInfo> {
        let info = self.tensor_info(name)?;
        if !info.ggml_type.can_dequantize() {
            return Err(gguf_error(
                &self.path,
                format!(
                    "tensor `{name}` has type {}, which cannot be dequantised (supported: {})",
                    info.ggml_type,
                    quant::SUPPORTED
                ),
            ));
        }
        Ok(info)
    }
}

pub(crate) fn gguf_error(path: &Path, message: impl Into<String>) -> FormatError {
    FormatError::Gguf {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// A short rendering of a value for error messages (arrays can hold 100k tokens).
fn brief(value: &GgufValue) -> String {
    match value {
        GgufValue::Array(items) => format!("of {} items", items.len()),
        GgufValue::String(s) if s.len() > 60 => {
            format!("{:?}…", s.chars().take(60).collect::<String>())
        }
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    fn sample_builder() -> GgufBuilder {
        let mut builder = GgufBuilder::new();
        builder
            .metadata("general.architecture", GgufValue::String("llama".into()))
            .metadata("u8", GgufValue::U8(200))
            .metadata("i8", GgufValue::I8(-5))
            .metadata("u16", GgufValue::U16(60_000))
            .metadata("i16", GgufValue::I16(-30_000))
            .metadata("u32", GgufValue::U32(4_000_000_000))
            .metadata("i32", GgufValue::I32(-7))
            .metadata("f32", GgufValue::F32(0.5))
            .metadata("bool", GgufValue::Bool(true))
            .metadata("u64", GgufValue::U64(1 << 40))
            .metadata("i64", GgufValue::I64(-(1 << 40)))
            .metadata("f64", GgufValue::F64(1e-6))
            .metadata(
                "strings",
                GgufValue::Array(vec![
                    GgufValue::String("Ġthe".into()),
                    GgufValue::String("a b".into()),
                ]),
            )
            .metadata(
                "nested",
                GgufValue::Array(vec![
                    GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(2)]),
                    GgufValue::Array(vec![GgufValue::I32(3)]),
                ]),
            )
            .tensor_f32("matrix", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .tensor_f32("vector", &[4], &[-1.0, -2.0, -3.0, -4.0]);
        let mut q8 = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        q8.extend((0..32).map(|i| i as u8));
        builder.tensor("q8", &[1, 32], GgmlType::Q8_0, q8);
        builder.tensor("q4k", &[256], GgmlType::Q4K, vec![0; 144]);
        builder
    }

    fn write_temp(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("model.gguf");
        std::fs::write(&path, bytes).expect("write temp gguf");
        (dir, path)
    }

    fn open_bytes(bytes: &[u8]) -> Result<GgufFile> {
        let (_dir, path) = write_temp(bytes);
        GgufFile::open(&path)
    }

    fn error_text(bytes: &[u8]) -> String {
        open_bytes(bytes)
            .expect_err("malformed file must not open")
            .to_string()
    }

    #[test]
    fn every_metadata_type_reads_back() {
        let gguf = open_bytes(&sample_builder().to_bytes()).expect("valid file");
        assert_eq!(gguf.version(), 3);
        assert_eq!(gguf.alignment(), 32);
        assert_eq!(
            gguf.get_str("general.architecture").expect("string"),
            "llama"
        );
        assert_eq!(gguf.get_u64("u8").expect("u8"), 200);
        assert_eq!(gguf.get("i8"), Some(&GgufValue::I8(-5)));
        assert_eq!(gguf.get_usize("u16").expect("u16"), 60_000);
        assert_eq!(gguf.get("i16"), Some(&GgufValue::I16(-30_000)));
        assert_eq!(gguf.get_u64("u32").expect("u32"), 4_000_000_000);
        assert_eq!(gguf.get_f64("f32").expect("f32"), 0.5);
        assert!(gguf.get_bool("bool").expect("bool"));
        assert_eq!(gguf.get_u64("u64").expect("u64"), 1 << 40);
        assert_eq!(gguf.get_f64("i64").expect("i64"), -(2f64.powi(40)));
        assert_eq!(gguf.get_f64("f64").expect("f64"), 1e-6);
        assert_eq!(
            gguf.get_str_array("strings").expect("strings"),
            vec!["Ġthe", "a b"]
        );
        let nested = gguf.get_array("nested").expect("nested");
        assert_eq!(nested[0].as_array().map(<[GgufValue]>::len), Some(2));
        assert_eq!(gguf.metadata().len(), 14);
    }

    #[test]
    fn wrong_type_and_missing_key_errors_name_key_and_file() {
        let (_dir, path) = write_temp(&sample_builder().to_bytes());
        let gguf = GgufFile::open(&path).expect("valid file");
        let err = gguf
            .get_str("u32")
            .expect_err("u32 is not a string")
            .to_string();
        assert!(
            err.contains("`u32`") && err.contains("uint32") && err.contains("model.gguf"),
            "{err}"
        );
        let err = gguf.get_u64("i32").expect_err("negative").to_string();
        assert!(
            err.contains("`i32`") && err.contains("non-negative"),
            "{err}"
        );
        let err = gguf
            .get_u64("llama.block_count")
            .expect_err("missing")
            .to_string();
        assert!(
            err.contains("missing metadata key `llama.block_count`"),
            "{err}"
        );
        assert_eq!(
            gguf.opt_u64("llama.block_count").expect("absent is fine"),
            None
        );
    }

    #[test]
    fn tensor_shapes_are_row_major_and_values_dequantise() {
        let gguf = open_bytes(&sample_builder().to_bytes()).expect("valid file");
        let matrix = gguf.tensor_info("matrix").expect("matrix");
        assert_eq!(matrix.shape, vec![2, 3]);
        assert_eq!(matrix.ggml_type, GgmlType::F32);
        assert_eq!(
            gguf.tensor_f32("matrix").expect("f32"),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        assert_eq!(
            gguf.tensor_f32("vector").expect("f32"),
            vec![-1.0, -2.0, -3.0, -4.0]
        );
        let q8 = gguf.tensor_f32("q8").expect("q8_0");
        assert_eq!(q8, (0..32).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
        assert_eq!(gguf.tensors().len(), 4);
    }

    #[test]
    fn unsupported_tensor_type_names_tensor_and_type() {
        let gguf = open_bytes(&sample_builder().to_bytes()).expect("valid file");
        let err = gguf
            .tensor_f32("q4k")
            .expect_err("Q4_K is not decoded")
            .to_string();
        assert!(err.contains("`q4k`") && err.contains("Q4_K"), "{err}");
        let err = gguf.tensor_f32("nope").expect_err("absent").to_string();
        assert!(err.contains("missing tensor `nope`"), "{err}");
    }

    #[test]
    fn version_2_files_open() {
        let mut bytes = sample_builder().to_bytes();
        bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
        let gguf = open_bytes(&bytes).expect("v2 has the same layout as v3");
        assert_eq!(gguf.version(), 2);
        assert_eq!(
            gguf.tensor_f32("vector").expect("f32"),
            vec![-1.0, -2.0, -3.0, -4.0]
        );
    }

    #[test]
    fn bad_magic_is_reported() {
        let mut bytes = sample_builder().to_bytes();
        bytes[..4].copy_from_slice(b"GGML");
        let err = error_text(&bytes);
        assert!(
            err.contains("bad magic") && err.contains("model.gguf"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_versions_are_reported() {
        let mut bytes = sample_builder().to_bytes();
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(error_text(&bytes).contains("version 1"));
        bytes[4..8].copy_from_slice(&7u32.to_le_bytes());
        assert!(error_text(&bytes).contains("unsupported GGUF version 7"));
        bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(error_text(&bytes).contains("big-endian"));
    }

    #[test]
    fn truncated_data_is_reported_as_tensor_past_end() {
        let bytes = sample_builder().to_bytes();
        let err = error_text(&bytes[..bytes.len() - 40]);
        assert!(
            err.contains("tensor `q4k`") && err.contains("truncated"),
            "{err}"
        );
    }

    #[test]
    fn string_longer_than_the_file_is_reported() {
        let mut builder = GgufBuilder::new();
        builder.metadata("name", GgufValue::String("abc".into()));
        let mut bytes = builder.to_bytes();
        // The value's length field follows magic, version, counts, key and type id.
        let at = 4 + 4 + 8 + 8 + 8 + 4 + 4;
        bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = error_text(&bytes);
        assert!(err.contains("length of metadata `name`"), "{err}");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample_builder().to_bytes();
        // The last tensor (Q4_K, 144 bytes) is followed by 16 bytes of alignment padding.
        for len in 0..bytes.len() - 16 {
            assert!(
                open_bytes(&bytes[..len]).is_err(),
                "prefix of {len} bytes opened"
            );
        }
    }

    #[test]
    fn random_corruption_never_panics() {
        let valid = sample_builder().to_bytes();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fuzz.gguf");
        for _ in 0..2000 {
            let mut bytes = valid.clone();
            for _ in 0..rng.random_range(1..6) {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = rng.random();
            }
            std::fs::write(&path, &bytes).expect("write fuzz file");
            if let Ok(gguf) = GgufFile::open(&path) {
                for info in gguf.tensors() {
                    let _ = gguf.tensor_f32(&info.name);
                }
            }
        }
    }
}
