//! Weight tensors: a dtype, a shape and bytes that are either a view into a memory-mapped
//! checkpoint or an owned, aligned buffer.
//!
//! Views are zero-copy; a tensor whose offset in the file is not aligned to its element size is
//! copied once at load into an owned buffer, so kernels can always reinterpret the bytes.

use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use memmap2::Mmap;
use moeserve_core::DType;

use crate::cpu::WeightQuantization;
use crate::cpu::fp8::{BlockScales, E4m3};
use crate::cpu::int4::Int4Panels;
use crate::cpu::mxfp4::Mxfp4Panels;
use crate::cpu::packed::PackedWeight;
use crate::cpu::quant::Int8Rows;
use crate::{BackendError, Result};

/// The bytes behind a [`Weight`].
#[derive(Clone)]
pub enum WeightBytes {
    /// `map[start..end]` of a memory-mapped file.
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        end: usize,
    },
    /// An owned buffer; `u64` words guarantee alignment for every element type.
    Owned { words: Arc<Vec<u64>>, len: usize },
}

impl WeightBytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            WeightBytes::Mapped { map, start, end } => &map[*start..*end],
            WeightBytes::Owned { words, len } => &bytemuck::cast_slice(words.as_slice())[..*len],
        }
    }

    /// Copies `bytes` into an aligned owned buffer.
    pub fn owned(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        WeightBytes::Owned {
            words: Arc::new(words),
            len: bytes.len(),
        }
    }
}

/// A read-only tensor of weights, row-major.
#[derive(Clone)]
pub struct Weight {
    dtype: DType,
    shape: Vec<usize>,
    bytes: WeightBytes,
    /// The kernel layout, made on first use and shared by clones.
    packed: Arc<OnceLock<PackedWeight>>,
    /// Whether `--quantization` may apply (false for small, sensitive matrices: routers).
    quantizable: bool,
    /// int8 rows stored in the checkpoint (`moeserve quantize`), used instead of quantizing
    /// the stored values when the process runs int8.
    int8: Option<Arc<Int8Rows>>,
    /// An FP8 matrix's block scales (set exactly when the dtype is `F8E4M3`).
    block_scales: Option<Arc<BlockScales>>,
    /// An MXFP4 matrix's panels, its only copy (set exactly when the dtype is `Mxfp4`; the
    /// bytes are then empty and `packed` holds the same panels).
    mxfp4: Option<Arc<Mxfp4Panels>>,
    /// A GPTQ / AWQ int4 matrix's panels, likewise its only copy (dtype `Int4`).
    int4: Option<Arc<Int4Panels>>,
    /// Packed at load from a layout the kernels cannot read ([`Weight::prepacked`]): the
    /// bytes are empty and the panels are the only copy.
    prepacked: bool,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weight({}, {:?})", self.dtype, self.shape)
    }
}

impl Weight {
    /// Wraps `bytes`; copies them into an owned buffer when they are misaligned for `dtype`.
    pub fn new(dtype: DType, shape: Vec<usize>, bytes: WeightBytes) -> Result<Self> {
        if dtype == DType::F8E4M3 {
            return Err(BackendError::Fp8Scales {
                message: format!("an FP8 tensor {shape:?} needs its block scales (Weight::fp8)"),
            });
        }
        if dtype == DType::Mxfp4 {
            return Err(BackendError::Mxfp4 {
                message: format!("an MXFP4 tensor {shape:?} is made by Weight::mxfp4"),
            });
        }
        if dtype == DType::Int4 {
            return Err(BackendError::Int4 {
                message: format!("an int4 tensor {shape:?} is made by Weight::int4"),
            });
        }
        Self::new_unchecked(dtype, shape, bytes)
    }

    /// An FP8 block matrix: `[n, k]` e4m3 `bytes` and the scales of its blocks.
    pub fn fp8(shape: Vec<usize>, bytes: WeightBytes, scales: BlockScales) -> Result<Self> {
        let [n, k] = shape[..] else {
            return Err(BackendError::Fp8Scales {
                message: format!("an FP8 tensor must be a matrix, got shape {shape:?}"),
            });
        };
        let [br, bc] = scales.block;
        let want = n.div_ceil(br.max(1)) * k.div_ceil(bc.max(1));
        if br == 0 || bc == 0 || scales.k != k || scales.scales.len() != want {
            return Err(BackendError::Fp8Scales {
                message: format!(
                    "[{n}, {k}] in blocks of {br} × {bc} needs {want} scales, got {} for {} \
                     columns",
                    scales.scales.len(),
                    scales.k
                ),
            });
        }
        let mut weight = Self::new_unchecked(DType::F8E4M3, shape, bytes)?;
        weight.block_scales = Some(Arc::new(scales));
        Ok(weight)
    }

    /// An MXFP4 matrix, already in its panels (made from the checkpoint's blocks at load): 4.25
    /// bits per weight, and no other copy. `--quantization` leaves it as it is.
    pub fn mxfp4(panels: Mxfp4Panels) -> Self {
        let panels = Arc::new(panels);
        Weight {
            dtype: DType::Mxfp4,
            shape: panels.shape().to_vec(),
            bytes: WeightBytes::owned(&[]),
            packed: Arc::new(OnceLock::from(PackedWeight::Mxfp4(panels.clone()))),
            quantizable: false,
            int8: None,
            block_scales: None,
            mxfp4: Some(panels),
            int4: None,
            prepacked: false,
        }
    }

    /// A GPTQ or AWQ int4 matrix, already in its panels (unpacked from the checkpoint's words
    /// at load): 4 bits per weight plus its groups' scales, and no other copy. `--quantization`
    /// leaves it as it is.
    pub fn int4(panels: Int4Panels) -> Self {
        let panels = Arc::new(panels);
        Weight {
            dtype: DType::Int4,
            shape: panels.shape().to_vec(),
            bytes: WeightBytes::owned(&[]),
            packed: Arc::new(OnceLock::from(PackedWeight::Int4(panels.clone()))),
            quantizable: false,
            int8: None,
            block_scales: None,
            mxfp4: None,
            int4: Some(panels),
            prepacked: false,
        }
    }

    /// A float matrix (f32, f16, bf16) already in the kernels' panels, made at load from a
    /// layout they cannot read (GPT-OSS's input-major experts), so no row-major copy is kept.
    /// For processes whose kernels pack weights and that run them as stored (no
    /// `--quantization`): elements read back through the panels.
    pub fn prepacked(dtype: DType, packed: PackedWeight) -> Result<Self> {
        let shape = match &packed {
            PackedWeight::F32(w) if dtype == DType::F32 => vec![w.n, w.k],
            PackedWeight::F16(w) if dtype == DType::F16 => vec![w.n, w.k],
            PackedWeight::BF16(w) if dtype == DType::BF16 => vec![w.n, w.k],
            _ => {
                return Err(BackendError::Prepacked {
                    message: format!("a {dtype} weight needs float panels of that dtype"),
                });
            }
        };
        Ok(Weight {
            dtype,
            shape,
            bytes: WeightBytes::owned(&[]),
            packed: Arc::new(OnceLock::from(packed)),
            quantizable: false,
            int8: None,
            block_scales: None,
            mxfp4: None,
            int4: None,
            prepacked: true,
        })
    }

    /// Whether the panels are this weight's only copy ([`Weight::prepacked`]): no row-major
    /// [`Weight::data`].
    pub fn is_prepacked(&self) -> bool {
        self.prepacked
    }

    fn new_unchecked(dtype: DType, shape: Vec<usize>, bytes: WeightBytes) -> Result<Self> {
        let numel: usize = shape.iter().product();
        let len = bytes.as_slice().len();
        if len != numel * dtype.size_in_bytes() {
            return Err(BackendError::ByteLength {
                op: "Weight::new",
                len,
                shape,
                dtype,
            });
        }
        let aligned = (bytes.as_slice().as_ptr() as usize).is_multiple_of(dtype.size_in_bytes());
        let bytes = if aligned {
            bytes
        } else {
            WeightBytes::owned(bytes.as_slice())
        };
        Ok(Weight {
            dtype,
            shape,
            bytes,
            packed: Arc::default(),
            quantizable: true,
            int8: None,
            block_scales: None,
            mxfp4: None,
            int4: None,
            prepacked: false,
        })
    }

    /// An owned f32 tensor, used for small derived weights and in tests.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self> {
        Weight::new(
            DType::F32,
            shape,
            WeightBytes::owned(bytemuck::cast_slice(values)),
        )
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The stored bytes (an MXFP4 matrix's: its panels' codes and scales).
    pub fn size_in_bytes(&self) -> usize {
        if let Some(p) = &self.int4 {
            return p.size_in_bytes();
        }
        match &self.mxfp4 {
            Some(p) => p.size_in_bytes(),
            None if self.prepacked => self.packed().size_in_bytes(),
            None => self.bytes.as_slice().len(),
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// The elements, typed; alignment was established in [`Weight::new`]. Not for a
    /// [`Weight::prepacked`] one (read it with [`Weight::to_f32_vec`] or the kernels).
    pub fn data(&self) -> WeightData<'_> {
        assert!(
            !self.prepacked,
            "Weight::data of a prepacked {:?} weight: its panels are its only copy",
            self.shape
        );
        let b = self.bytes.as_slice();
        match self.dtype {
            DType::F32 => WeightData::F32(bytemuck::cast_slice(b)),
            DType::F16 => WeightData::F16(bytemuck::cast_slice(b)),
            DType::BF16 => WeightData::BF16(bytemuck::cast_slice(b)),
            DType::F8E4M3 => WeightData::F8E4M3(
                bytemuck::cast_slice(b),
                self.block_scales
                    .as_deref()
                    .expect("FP8 weights have block scales"),
            ),
            DType::Mxfp4 => {
                WeightData::Mxfp4(self.mxfp4.as_deref().expect("MXFP4 weights have panels"))
            }
            DType::Int4 => {
                WeightData::Int4(self.int4.as_deref().expect("int4 weights have panels"))
            }
        }
    }

    /// The same weight in a fresh owned buffer with its own packed form (what placing an
    /// expert on another device means on the CPU): dtype, shape, block scales, stored int8
    /// rows and whether `--quantization` applies all kept.
    pub fn deep_copy(&self) -> Self {
        if let Some(p) = &self.mxfp4 {
            return Weight::mxfp4((**p).clone());
        }
        if let Some(p) = &self.int4 {
            return Weight::int4((**p).clone());
        }
        if self.prepacked {
            return Weight {
                packed: Arc::new(OnceLock::from(self.packed().clone())),
                ..self.clone()
            };
        }
        Weight {
            bytes: WeightBytes::owned(self.as_bytes()),
            packed: Arc::default(),
            ..self.clone()
        }
    }

    /// Keeps this weight as stored whatever `--quantization` says (call before first use).
    pub fn exact(mut self) -> Self {
        self.quantizable = false;
        self
    }

    /// Uses `rows` (`[n, k]` with the GEMM's groups) as this weight's int8 form instead of
    /// quantizing the stored values; the stored values stay for runs without `--quantization`.
    /// The clone gets its own packed form (a tied embedding keeps its rows as stored).
    pub fn with_int8(&self, rows: Int8Rows) -> Result<Self> {
        if self.prepacked {
            return Err(BackendError::Prepacked {
                message: format!(
                    "{:?} has no rows to take int8 ones beside (prepacked only when running as \
                     stored)",
                    self.shape
                ),
            });
        }
        let (n, k) = match self.shape[..] {
            [n, k] => (n, k),
            _ => (0, 0),
        };
        let groups = n * k.div_ceil(crate::cpu::quant::GROUP);
        if self.shape.len() != 2
            || rows.q.len() != n * k
            || rows.scales.len() != groups
            || rows.offsets.len() != groups
        {
            return Err(BackendError::ShapeMismatch {
                op: "Weight::with_int8",
                expected: self.shape.clone(),
                got: vec![rows.q.len(), rows.scales.len(), rows.offsets.len()],
            });
        }
        Ok(Weight {
            packed: Arc::default(),
            int8: Some(Arc::new(rows)),
            ..self.clone()
        })
    }

    /// This weight with `packed` as its panels (tests: an int8 weight in a process that runs
    /// as stored).
    #[cfg(test)]
    pub(crate) fn with_packed(self, packed: PackedWeight) -> Self {
        Weight {
            packed: Arc::new(OnceLock::from(packed)),
            ..self
        }
    }

    /// Whether the checkpoint supplied this weight's int8 form ([`Weight::with_int8`]).
    pub fn has_stored_int8(&self) -> bool {
        self.int8.is_some()
    }

    /// The weight in the GEMM's panel layout (2-D weights only), quantized when the process
    /// chose a quantization and the weight allows it; packed once, on first use.
    pub fn packed(&self) -> &PackedWeight {
        self.packed.get_or_init(|| {
            let (n, k) = (self.shape[0], self.shape[1]);
            match crate::cpu::weight_quantization() {
                WeightQuantization::Int8 if self.quantizable => match &self.int8 {
                    Some(rows) => PackedWeight::pack_int8_rows(rows, n, k),
                    None => PackedWeight::pack_int8(self.data(), n, k),
                },
                _ => PackedWeight::pack(self.data(), n, k),
            }
        })
    }

    /// Bytes one pass of the kernels over this weight reads: the packed (maybe quantized)
    /// form once it exists, else the stored bytes.
    pub fn kernel_bytes(&self) -> usize {
        self.packed
            .get()
            .map_or(self.size_in_bytes(), PackedWeight::size_in_bytes)
    }

    /// Element `i` of the flattened tensor as f32 (slow; for small tensors and tests).
    pub fn get_f32(&self, i: usize) -> f32 {
        if self.prepacked {
            let k = self.shape[1];
            return self.packed().float_value(i / k, i % k);
        }
        match self.data() {
            WeightData::F32(v) => v[i],
            WeightData::F16(v) => v[i].to_f32(),
            WeightData::BF16(v) => v[i].to_f32(),
            WeightData::F8E4M3(v, s) => v[i].to_f32() * s.at(i / s.k, i % s.k),
            WeightData::Mxfp4(p) => p.value(i / p.shape()[1], i % p.shape()[1]),
            WeightData::Int4(p) => p.value(i / p.shape()[1], i % p.shape()[1]),
        }
    }

    /// The whole tensor widened to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        if self.prepacked {
            return (0..self.numel()).map(|i| self.get_f32(i)).collect();
        }
        let mut out = vec![0.0; self.numel()];
        crate::cpu::convert::widen_into(self.data(), &mut out);
        out
    }

    /// Checks that the tensor has `expected` shape.
    pub fn expect_shape(&self, op: &'static str, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(BackendError::ShapeMismatch {
                op,
                expected: expected.to_vec(),
                got: self.shape.clone(),
            });
        }
        Ok(())
    }
}

/// Typed view of a weight's elements.
#[derive(Clone, Copy)]
pub enum WeightData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    /// FP8 block matrix: the elements and their blocks' scales.
    F8E4M3(&'a [E4m3], &'a BlockScales),
    /// MXFP4 matrix, in its panels.
    Mxfp4(&'a Mxfp4Panels),
    /// GPTQ / AWQ int4 matrix, in its panels.
    Int4(&'a Int4Panels),
}

impl WeightData<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightData::F32(v) => v.len(),
            WeightData::F16(v) => v.len(),
            WeightData::BF16(v) => v.len(),
            WeightData::F8E4M3(v, _) => v.len(),
            WeightData::Mxfp4(p) => p.shape().iter().product(),
            WeightData::Int4(p) => p.shape().iter().product(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
