//! HF checkpoints in safetensors format: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, memory-mapped; tensors are looked up by hub name.
//!
//! Files are validated when opened (header, offsets, file length) so a truncated download is
//! reported at start-up with its path, not as a crash in the middle of a forward pass.
//!
//! FP8 block checkpoints (`quantization_config: {"quant_method": "fp8", "weight_block_size":
//! [rows, cols]}`, DeepSeek-V3/R1 and the Qwen3 FP8 releases) store a matrix as `F8_E4M3`
//! `{name}.weight` beside its f32 `{name}.weight_scale_inv` (one scale per block, the factor to
//! multiply by); such a matrix loads as an FP8 [`Weight`] that the kernels widen as they go.
//!
//! GPTQ and AWQ int4 checkpoints store a quantized layer as packed words, zero points and
//! scales instead of `{name}.weight`; such a matrix loads as int4 panels (`int4.rs`).

mod int4;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use moeserve_backend::cpu::quant::{GROUP, Int8Rows};
use moeserve_backend::cpu::{WeightQuantization, weight_quantization};
use moeserve_backend::{Weight, WeightBytes};
use moeserve_core::DType;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::{ModelError, Result};
pub use int4::Int4Format;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where one tensor lives.
#[derive(Clone, Debug)]
struct TensorEntry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// The memory-mapped tensors of one checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: HashMap<String, TensorEntry>,
    /// Whether weights ignore `--quantization` and stored int8 tensors ([`Checkpoint::as_stored`]).
    as_stored: bool,
    /// `quantization_config.weight_block_size` of an FP8 checkpoint's config.json.
    fp8_block: Option<[usize; 2]>,
    /// The int4 format of a GPTQ or AWQ checkpoint's config.json.
    int4: Option<Int4Format>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors` or the shards named in `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let file_names = if index_path.exists() {
            shard_names(&index_path)?
        } else if dir.join(SINGLE_FILE).exists() {
            vec![SINGLE_FILE.to_string()]
        } else {
            return Err(ModelError::config(
                dir,
                format!("no {SINGLE_FILE} or {INDEX_FILE} in the model directory"),
            ));
        };
        let mut checkpoint = Checkpoint {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tensors: HashMap::new(),
            as_stored: false,
            fp8_block: fp8_block_size(dir)?,
            int4: int4_format(dir)?,
        };
        for name in file_names {
            checkpoint.add_file(&dir.join(name))?;
        }
        Ok(checkpoint)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the checkpoint is opened read-only; like every mmap-based loader (vLLM, candle)
        // we assume nobody truncates the file while the server runs.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let file_index = self.files.len();
        let parsed = SafeTensors::deserialize(&map[..]).map_err(|e| ModelError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let base = map.as_ptr() as usize;
        for (name, view) in parsed.tensors() {
            let start = view.data().as_ptr() as usize - base;
            let entry = TensorEntry {
                file: file_index,
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                start,
                end: start + view.data().len(),
            };
            self.tensors.insert(name, entry);
        }
        self.files.push((path.to_path_buf(), Arc::new(map)));
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes [`Checkpoint::weight`] return weights as stored whatever `--quantization` says,
    /// without the checkpoint's int8 tensors (the calibration pass of `moeserve quantize`).
    pub fn as_stored(mut self) -> Self {
        self.as_stored = true;
        self
    }

    /// Every tensor's name and the name of the file holding it.
    pub fn tensor_files(&self) -> impl Iterator<Item = (&str, &str)> {
        self.tensors.iter().map(|(name, entry)| {
            let path = &self.files[entry.file].0;
            let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
            (name.as_str(), file)
        })
    }

    /// The int8 form of matrix `{prefix}.weight` (`[n, k]`) written by `moeserve quantize`:
    /// `{prefix}.qweight` (i8 `[n, k]`), `{prefix}.scales` and `{prefix}.offsets` (f32
    /// `[n, k / 64]`); `None` when the checkpoint has no `{prefix}.qweight`.
    pub fn int8_rows(&self, prefix: &str, n: usize, k: usize) -> Result<Option<Int8Rows>> {
        let qweight = format!("{prefix}.qweight");
        // A GPTQ / AWQ checkpoint's `qweight` is its int4 words, not these rows.
        if self.as_stored || self.int4.is_some() || !self.tensors.contains_key(&qweight) {
            return Ok(None);
        }
        let groups = k.div_ceil(GROUP);
        let q = self.raw(&qweight, Dtype::I8, &[n, k])?;
        let scales = self.raw(&format!("{prefix}.scales"), Dtype::F32, &[n, groups])?;
        let offsets = self.raw(&format!("{prefix}.offsets"), Dtype::F32, &[n, groups])?;
        // Copies that need no alignment of the mapped bytes.
        Ok(Some(Int8Rows {
            q: bytemuck::pod_collect_to_vec(q),
            scales: bytemuck::pod_collect_to_vec(scales),
            offsets: bytemuck::pod_collect_to_vec(offsets),
        }))
    }

    /// Tensor `name`'s entry and file, checked to have `shape`.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<(&TensorEntry, &PathBuf)> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.dir.clone(),
                name: name.to_string(),
            })?;
        let path = &self.files[entry.file].0;
        if entry.shape != shape {
            return Err(ModelError::TensorShape {
                path: path.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                got: entry.shape.clone(),
            });
        }
        Ok((entry, path))
    }

    /// [`Checkpoint::int8_rows`] when the process runs int8: a matrix `moeserve quantize` stored
    /// in int8 too (`--quantization none` runs the stored values and needs no copy of them).
    pub fn int8_for_kernels(&self, prefix: &str, n: usize, k: usize) -> Result<Option<Int8Rows>> {
        if weight_quantization() != WeightQuantization::Int8 {
            return Ok(None);
        }
        self.int8_rows(prefix, n, k)
    }

    /// The bytes of tensor `name`, checked to have `dtype` and `shape`.
    fn raw(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<&[u8]> {
        let (entry, path) = self.entry(name, shape)?;
        if entry.dtype != dtype {
            return Err(ModelError::UnsupportedDType {
                path: path.clone(),
                name: name.to_string(),
                dtype: format!("{:?} (expected {dtype:?})", entry.dtype),
            });
        }
        Ok(&self.files[entry.file].1[entry.start..entry.end])
    }

    /// Whether the checkpoint has tensor `name`, or (`{prefix}.weight` of a GPTQ or AWQ
    /// checkpoint) the int4 layer that stands for it.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
            || (self.int4.is_some()
                && name
                    .strip_suffix(".weight")
                    .is_some_and(|prefix| self.tensors.contains_key(&format!("{prefix}.qweight"))))
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The shape the header gives tensor `name`.
    pub fn tensor_shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// The tensor `name`, checked to have `expected_shape` and a float dtype; zero-copy. In a
    /// GPTQ or AWQ checkpoint, a quantized layer's `{prefix}.weight` is its int4 matrix.
    pub fn weight(&self, name: &str, expected_shape: &[usize]) -> Result<Weight> {
        if let Some(weight) = self.int4_weight(name, expected_shape)? {
            return Ok(weight);
        }
        let int8_prefix = name.strip_suffix(".weight");
        self.weight_view(name, expected_shape, (0, expected_shape), int8_prefix)
    }

    /// Part `index` of tensor `name` (checked to have `shape`) cut into consecutive parts of
    /// `part_shape`: one expert's matrix of a fused `[E, rows, cols]` expert tensor; zero-copy.
    /// Its int8 form, where `moeserve quantize` stored one, is `{int8_prefix}.qweight`.
    pub fn weight_part(
        &self,
        name: &str,
        shape: &[usize],
        index: usize,
        part_shape: &[usize],
        int8_prefix: &str,
    ) -> Result<Weight> {
        self.weight_view(name, shape, (index, part_shape), Some(int8_prefix))
    }

    /// Expert `index`'s matrix of an input-major fused tensor `name` (`[E, k, n·step]`, each
    /// expert's `[k, n·step]` in `x · W` order, as GPT-OSS stores `gate_up_proj`): its columns
    /// `first, first + step, …` transposed into the kernels' `[n, k]` rows, in the stored
    /// dtype. When the kernels pack and run the stored values, packed straight into their
    /// panels (the only copy, [`Weight::prepacked`]); else a transposed copy. Its int8 form,
    /// where `moeserve quantize` stored one, is `{int8_prefix}.qweight`.
    pub fn weight_columns(
        &self,
        name: &str,
        shape: &[usize],
        index: usize,
        (first, step): (usize, usize),
        int8_prefix: &str,
    ) -> Result<Weight> {
        let (entry, path) = self.entry(name, shape)?;
        let &[experts, k, cols] = shape else {
            return Err(ModelError::config(
                path,
                format!("`{name}`: an input-major expert tensor is 3-D, got {shape:?}"),
            ));
        };
        let dtype = match entry.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedDType {
                    path: path.clone(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        assert!(index < experts && first < step && cols.is_multiple_of(step));
        let n = cols / step;
        let size = dtype.size_in_bytes();
        let bytes = &self.files[entry.file].1[entry.start..entry.end];
        let expert = &bytes[index * k * cols * size..][..k * cols * size];
        // Kernels that pack and run the stored values: packed straight from the mapped
        // columns, the panels the only copy (a transposed copy would be a second one).
        if !self.as_stored
            && weight_quantization() == WeightQuantization::None
            && moeserve_backend::cpu::isa().packs_weights()
        {
            use moeserve_backend::cpu::packed::{PackedPanels, PackedWeight, PanelSlot};
            fn columns<T: bytemuck::Pod + Default + PanelSlot>(
                e: &[u8],
                k: usize,
                c: (usize, usize),
            ) -> PackedPanels<T> {
                PackedPanels::pack_columns(&typed::<T>(e), k, c)
            }
            let at = (first, step);
            let packed = match dtype {
                DType::F32 => PackedWeight::F32(columns(expert, k, at)),
                DType::F16 => PackedWeight::F16(columns(expert, k, at)),
                // The match above admits f32, f16 and bf16 only.
                _ => PackedWeight::BF16(columns(expert, k, at)),
            };
            return Ok(Weight::prepacked(dtype, packed)?);
        }
        let mut rows = vec![0u8; n * k * size];
        for (r, row) in rows.chunks_exact_mut(k * size).enumerate() {
            let col = first + r * step;
            for (i, out) in row.chunks_exact_mut(size).enumerate() {
                out.copy_from_slice(&expert[(i * cols + col) * size..][..size]);
            }
        }
        let weight = Weight::new(dtype, vec![n, k], WeightBytes::owned(&rows))?;
        self.for_kernels(weight, Some(int8_prefix))
    }

    /// Expert `index`'s rows `first, first + step, …` of the MXFP4 matrix `name` as the
    /// gpt-oss release stores it: `{name}_blocks` u8 `[E, rows, cols / 32, 16]` (two e2m1
    /// values per byte, low nibble first) and `{name}_scales` u8 e8m0 `[E, rows, cols / 32]`,
    /// with `shape = [E, rows, cols]` the dequantised matrix's, rows the output features. Packed
    /// into the kernels' 4-bit panels (no wider copy is made).
    pub fn mxfp4_rows(
        &self,
        name: &str,
        shape: [usize; 3],
        index: usize,
        (first, step): (usize, usize),
    ) -> Result<Weight> {
        use moeserve_backend::cpu::mxfp4::{BLOCK, Mxfp4Panels};
        let [experts, rows, cols] = shape;
        let (blocks_name, scales_name) = (format!("{name}_blocks"), format!("{name}_scales"));
        if !cols.is_multiple_of(BLOCK) {
            let (_, path) = self.entry(&blocks_name, &[experts, rows, cols / BLOCK, BLOCK / 2])?;
            return Err(ModelError::config(
                path,
                format!("`{blocks_name}`: rows of {cols} are not whole MXFP4 blocks of {BLOCK}"),
            ));
        }
        let groups = cols / BLOCK;
        let blocks = self.raw(&blocks_name, Dtype::U8, &[experts, rows, groups, BLOCK / 2])?;
        let scales = self.raw(&scales_name, Dtype::U8, &[experts, rows, groups])?;
        assert!(index < experts && first < step && rows.is_multiple_of(step));
        let row_bytes = cols / 2;
        let (blocks, scales) = (
            &blocks[index * rows * row_bytes..][..rows * row_bytes],
            &scales[index * rows * groups..][..rows * groups],
        );
        let panels = Mxfp4Panels::from_rows(rows / step, cols, |r| {
            let stored = first + r * step;
            (
                &blocks[stored * row_bytes..][..row_bytes],
                &scales[stored * groups..][..groups],
            )
        })
        .map_err(|message| {
            let path = &self.files[self.tensors[&scales_name].file].0;
            ModelError::config(path, format!("`{name}` expert {index}: {message}"))
        })?;
        Ok(Weight::mxfp4(panels))
    }

    /// The float vector `name` (a bias, a norm), widened into f32 from its stored dtype: the
    /// whole of a `[len]` tensor, or row `index` of a `[rows, len]` one.
    pub fn vector_part(&self, name: &str, shape: &[usize], index: usize) -> Result<Vec<f32>> {
        let len = *shape.last().expect("a vector shape");
        Ok(self
            .weight_view(name, shape, (index, &[len]), None)?
            .to_f32_vec())
    }

    fn weight_view(
        &self,
        name: &str,
        expected_shape: &[usize],
        (index, part_shape): (usize, &[usize]),
        int8_prefix: Option<&str>,
    ) -> Result<Weight> {
        let (entry, path) = self.entry(name, expected_shape)?;
        let dtype = match entry.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::F8_E4M3 => {
                let weight = self.fp8_weight(name, entry, path, (index, part_shape))?;
                return self.for_kernels(weight, int8_prefix);
            }
            other => {
                return Err(ModelError::UnsupportedDType {
                    path: path.clone(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let part_bytes = part_shape.iter().product::<usize>() * dtype.size_in_bytes();
        let start = entry.start + index * part_bytes;
        if start + part_bytes > entry.end {
            return Err(ModelError::TensorShape {
                path: path.clone(),
                name: format!("{name} (part {index})"),
                expected: part_shape.to_vec(),
                got: entry.shape.clone(),
            });
        }
        let bytes = WeightBytes::Mapped {
            map: self.files[entry.file].1.clone(),
            start,
            end: start + part_bytes,
        };
        self.for_kernels(Weight::new(dtype, part_shape.to_vec(), bytes)?, int8_prefix)
    }

    /// `weight` as the kernels take it: as stored ([`Checkpoint::as_stored`]), or with the int8
    /// rows `moeserve quantize` stored for `{int8_prefix}` when the process runs int8.
    fn for_kernels(&self, weight: Weight, int8_prefix: Option<&str>) -> Result<Weight> {
        if self.as_stored {
            return Ok(weight.exact());
        }
        let int8 = match (int8_prefix, weight.shape()) {
            (Some(prefix), &[n, k]) => self.int8_for_kernels(prefix, n, k)?,
            _ => None,
        };
        match int8 {
            Some(rows) => Ok(weight.with_int8(rows)?),
            None => Ok(weight),
        }
    }
}

impl Checkpoint {
    /// The FP8 matrix `name` with the scales of `{name}_scale_inv`.
    fn fp8_weight(
        &self,
        name: &str,
        entry: &TensorEntry,
        path: &Path,
        (index, part_shape): (usize, &[usize]),
    ) -> Result<Weight> {
        let bad = |message: String| ModelError::config(path, format!("`{name}`: {message}"));
        let &[n, k] = part_shape else {
            return Err(bad(format!(
                "FP8 is for matrices; this tensor has shape {part_shape:?}"
            )));
        };
        if index != 0 || entry.shape != part_shape {
            return Err(bad(
                "FP8 experts fused into one tensor are not supported (per-expert tensors are)"
                    .into(),
            ));
        }
        let block = self.fp8_block.ok_or_else(|| {
            bad(
                "an F8_E4M3 tensor, but config.json has no quantization_config.weight_block_size"
                    .into(),
            )
        })?;
        let scale_name = format!("{name}_scale_inv");
        let shape = [n.div_ceil(block[0]), k.div_ceil(block[1])];
        let scales = self.raw(&scale_name, Dtype::F32, &shape)?;
        let scales = moeserve_backend::cpu::fp8::BlockScales {
            block,
            k,
            scales: bytemuck::pod_collect_to_vec(scales),
        };
        if let Some(s) = scales
            .scales
            .iter()
            .find(|s| !(s.is_finite() && **s >= 0.0))
        {
            return Err(bad(format!("{scale_name} holds {s}, not a finite scale")));
        }
        let bytes = WeightBytes::Mapped {
            map: self.files[entry.file].1.clone(),
            start: entry.start,
            end: entry.end,
        };
        Ok(Weight::fp8(part_shape.to_vec(), bytes, scales)?)
    }
}

/// `bytes` as `T`s: a view when they are aligned for `T`, else a copy.
fn typed<T: bytemuck::Pod>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(values) => std::borrow::Cow::Borrowed(values),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// `quantization_config.weight_block_size` of `dir/config.json` when it says `fp8`, or when
/// the int8 checkpoint `moeserve quantize` made of an FP8 one keeps that config beside its own;
/// other quantization methods are not this module's (the int8 tensors are read elsewhere).
fn fp8_block_size(dir: &Path) -> Result<Option<[usize; 2]>> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let Ok(config) = serde_json::from_str::<Value>(&text) else {
        return Ok(None);
    };
    let Some(mut q) = config.get("quantization_config") else {
        return Ok(None);
    };
    if let Some(source) = q.get(crate::quantize::SOURCE_QUANTIZATION) {
        q = source;
    }
    if q.get("quant_method").and_then(Value::as_str) != Some("fp8") {
        return Ok(None);
    }
    let bad = |message: &str| Err(ModelError::config(&path, message.to_string()));
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str)
        && fmt != "e4m3"
    {
        return bad("quantization_config.fmt must be \"e4m3\" (the FP8 releases' format)");
    }
    match q
        .get("weight_block_size")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    {
        Some([rows, cols]) => match (rows.as_u64(), cols.as_u64()) {
            (Some(r), Some(c)) if r > 0 && c > 0 => Ok(Some([r as usize, c as usize])),
            _ => bad("quantization_config.weight_block_size must be two positive integers"),
        },
        _ => bad(
            "quantization_config.weight_block_size must be [rows, cols] (per-tensor FP8 is not \
             supported; the block checkpoints of DeepSeek-V3 and Qwen3 are)",
        ),
    }
}

/// The int4 format `dir/config.json` names (GPTQ, AWQ), if any.
fn int4_format(dir: &Path) -> Result<Option<Int4Format>> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(config) => Int4Format::from_config(&path, &config),
        Err(_) => Ok(None),
    }
}

/// The distinct shard file names of an index, in a stable order.
fn shard_names(index_path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index_path).map_err(|e| ModelError::io(index_path, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::config(index_path, format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError::config(index_path, "missing object `weight_map`"))?;
    let mut files = BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            ModelError::config(
                index_path,
                format!("weight_map[{tensor:?}] is not a file name"),
            )
        })?;
        if file.contains('/') || file.contains("..") {
            return Err(ModelError::config(
                index_path,
                format!("shard name {file:?} must be a plain file name"),
            ));
        }
        files.insert(file.to_string(), ());
    }
    Ok(files.into_keys().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_single(dir: &Path, tensors: &[(&str, Dtype, Vec<usize>)]) {
        let datas: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, dt, shape)| vec![0u8; shape.iter().product::<usize>() * dt.bitsize() / 8])
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .zip(&datas)
            .map(|((n, dt, shape), d)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*dt, shape.clone(), d).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(SINGLE_FILE)).unwrap();
    }

    #[test]
    fn loads_weight_and_checks_shape_and_dtype() {
        let dir = tempfile::tempdir().unwrap();
        write_single(
            dir.path(),
            &[("a", Dtype::BF16, vec![2, 3]), ("b", Dtype::I64, vec![4])],
        );
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let w = ckpt.weight("a", &[2, 3]).unwrap();
        assert_eq!((w.dtype(), w.shape()), (DType::BF16, &[2usize, 3][..]));
        let msg = ckpt.weight("a", &[3, 2]).unwrap_err().to_string();
        assert!(
            msg.contains("`a` has shape [2, 3], expected [3, 2]"),
            "{msg}"
        );
        let msg = ckpt.weight("b", &[4]).unwrap_err().to_string();
        assert!(msg.contains("unsupported dtype I64"), "{msg}");
        let msg = ckpt.weight("c", &[1]).unwrap_err().to_string();
        assert!(msg.contains("missing tensor `c`"), "{msg}");
    }

    #[test]
    fn truncated_file_is_reported_with_path() {
        let dir = tempfile::tempdir().unwrap();
        write_single(dir.path(), &[("a", Dtype::F32, vec![64])]);
        let path = dir.path().join(SINGLE_FILE);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        let msg = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(
            msg.contains("model.safetensors") && msg.contains("invalid safetensors"),
            "{msg}"
        );
    }

    #[test]
    fn empty_directory_says_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let msg = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(msg.contains("no model.safetensors"), "{msg}");
    }

    fn fp8_config(dir: &Path, block: &str) {
        let config = format!(
            r#"{{"quantization_config": {{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": {block}}}}}"#
        );
        std::fs::write(dir.join("config.json"), config).unwrap();
    }

    #[test]
    fn fp8_matrices_load_with_their_block_scales_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        write_single(
            dir.path(),
            &[
                ("w.weight", Dtype::F8_E4M3, vec![40, 20]),
                ("w.weight_scale_inv", Dtype::F32, vec![3, 2]),
                ("bad.weight", Dtype::F8_E4M3, vec![40, 20]),
                ("bad.weight_scale_inv", Dtype::F32, vec![2, 2]),
                ("orphan.weight", Dtype::F8_E4M3, vec![40, 20]),
                ("norm.weight", Dtype::F8_E4M3, vec![20]),
            ],
        );
        fp8_config(dir.path(), "[16, 16]");
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let w = ckpt.weight("w.weight", &[40, 20]).unwrap();
        assert_eq!(w.dtype(), DType::F8E4M3);
        assert_eq!(w.size_in_bytes(), 40 * 20);
        let msg = ckpt
            .weight("bad.weight", &[40, 20])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`bad.weight_scale_inv` has shape [2, 2], expected [3, 2]"),
            "{msg}"
        );
        let msg = ckpt
            .weight("orphan.weight", &[40, 20])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("missing tensor `orphan.weight_scale_inv`"),
            "{msg}"
        );
        let msg = ckpt.weight("norm.weight", &[20]).unwrap_err().to_string();
        assert!(msg.contains("FP8 is for matrices"), "{msg}");
        // Without the block size in config.json the tensors cannot be read.
        fp8_config(dir.path(), "null");
        let msg = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(
            msg.contains("weight_block_size must be [rows, cols]"),
            "{msg}"
        );
        std::fs::remove_file(dir.path().join("config.json")).unwrap();
        let msg = Checkpoint::open(dir.path())
            .unwrap()
            .weight("w.weight", &[40, 20])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("no quantization_config.weight_block_size"),
            "{msg}"
        );
    }
}
