//! The GGUF v2/v3 header parser: magic, version, metadata key/values, tensor infos and the
//! start of the aligned data section.
//!
//! Follows the GGUF spec (ggml `docs/gguf.md`) and llama.cpp's `gguf_init_from_file_impl`
//! checks. Input is untrusted: every length is checked against the bytes that remain before
//! anything is allocated or sliced, nesting is bounded, and every problem comes back as a
//! message naming the byte offset and the item being read, never as a panic.

use std::collections::HashSet;

use super::quant::GgmlType;
use super::value::{GgufValue, ValueType};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this are rejected (no real file nests more than once).
const MAX_ARRAY_DEPTH: usize = 8;

/// Where one tensor lives and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Row-major shape as numpy shows it: ggml's `ne` reversed (`ne[0]` is the last, fastest axis).
    pub shape: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Offset of the tensor's data from the start of the data section.
    pub offset: usize,
}

impl GgufTensorInfo {
    pub fn num_elements(&self) -> usize {
        // Checked for overflow when the file was parsed.
        self.shape.iter().product()
    }

    /// Bytes the data takes, or `None` for an unknown type.
    pub fn byte_size(&self) -> Option<usize> {
        self.ggml_type.byte_size(self.num_elements())
    }
}

/// Everything before the data section.
pub(crate) struct Header {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: usize,
    /// Absolute file offset of the data section.
    pub data_offset: usize,
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "{what} at byte {} needs {n} bytes but the file ends after {} more",
                self.pos,
                self.remaining()
            ));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let bytes = self.take(N, what)?;
        Ok(bytes.try_into().expect("take returned exactly N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count or length that must fit in what is left of the file at `min_item_size` bytes
    /// per item.
    fn count(&mut self, what: &str, min_item_size: usize) -> Result<usize, String> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_item_size).map(|bytes| (n, bytes)))
            .filter(|&(_, bytes)| bytes <= self.remaining());
        match fits {
            Some((n, _)) => Ok(n),
            None => Err(format!(
                "{what} at byte {at} is {n}, more than the {} bytes left in the file can hold",
                self.remaining()
            )),
        }
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.count(&format!("length of {what}"), 1)?;
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: ValueType, what: &str, depth: usize) -> Result<GgufValue, String> {
        Ok(match ty {
            ValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => GgufValue::U32(self.u32(what)?),
            ValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => GgufValue::U64(self.u64(what)?),
            ValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => {
                let at = self.pos;
                match self.array::<1>(what)?[0] {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    other => {
                        return Err(format!("{what} at byte {at} is bool {other}, not 0 or 1"));
                    }
                }
            }
            ValueType::String => GgufValue::String(self.string(what)?),
            ValueType::Array => self.array_value(what, depth)?,
        })
    }

    fn array_value(&mut self, what: &str, depth: usize) -> Result<GgufValue, String> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!(
                "{what} at byte {} nests arrays deeper than {MAX_ARRAY_DEPTH}",
                self.pos
            ));
        }
        let element_type = self.value_type(&format!("element type of {what}"))?;
        let len = self.count(
            &format!("length of {what}"),
            element_type.min_encoded_size(),
        )?;
        let mut items = Vec::with_capacity(len);
        for i in 0..len {
            items.push(self.value(element_type, &format!("{what}[{i}]"), depth + 1)?);
        }
        Ok(GgufValue::Array(items))
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType, String> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id)
            .ok_or_else(|| format!("{what} at byte {at} is {id}, not a GGUF value type (0..=12)"))
    }
}

/// Parses the header of a GGUF file held in `bytes`.
pub(crate) fn parse_header(bytes: &[u8]) -> Result<Header, String> {
    let mut cursor = Cursor { bytes, pos: 0 };
    let magic = cursor.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(format!(
            "bad magic {magic:02x?}, expected \"GGUF\" (not a GGUF file)"
        ));
    }
    let version = cursor.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (only 2 and 3)".to_string()),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err("big-endian GGUF files are not supported".to_string());
        }
        v => return Err(format!("unsupported GGUF version {v} (only 2 and 3)")),
    }
    // Minimum encoded sizes: name length + ndims + type + offset; key length + type + 1 byte.
    let tensor_count = cursor.count("tensor count", 8 + 4 + 4 + 8)?;
    let kv_count = cursor.count("metadata count", 8 + 4 + 1)?;

    let metadata = read_metadata(&mut cursor, kv_count)?;
    let alignment = alignment(&metadata)?;
    let tensors = read_tensor_infos(&mut cursor, tensor_count)?;

    let data_offset = cursor.pos.next_multiple_of(alignment);
    let data_len = bytes.len().saturating_sub(data_offset);
    for tensor in &tensors {
        check_tensor_bounds(tensor, alignment, data_len)?;
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn read_metadata(
    cursor: &mut Cursor<'_>,
    count: usize,
) -> Result<Vec<(String, GgufValue)>, String> {
    let mut metadata = Vec::with_capacity(count);
    let mut seen = HashSet::new();
    for i in 0..count {
        let key = cursor.string(&format!("key of metadata entry {i}"))?;
        let what = format!("metadata `{key}`");
        let ty = cursor.value_type(&format!("type of {what}"))?;
        let value = cursor.value(ty, &what, 0)?;
        if !seen.insert(key.clone()) {
            return Err(format!("duplicate metadata key `{key}`"));
        }
        metadata.push((key, value));
    }
    Ok(metadata)
}

fn alignment(metadata: &[(String, GgufValue)]) -> Result<usize, String> {
    let Some((_, value)) = metadata.iter().find(|(key, _)| key == "general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match value {
        GgufValue::U32(a) if a.is_power_of_two() => Ok(*a as usize),
        other => Err(format!(
            "`general.alignment` must be a uint32 power of two, got {} {other:?}",
            other.type_name()
        )),
    }
}

fn read_tensor_infos(cursor: &mut Cursor<'_>, count: usize) -> Result<Vec<GgufTensorInfo>, String> {
    let mut tensors = Vec::with_capacity(count);
    let mut seen = HashSet::new();
    for i in 0..count {
        let name = cursor.string(&format!("name of tensor info {i}"))?;
        let what = format!("tensor `{name}`");
        let at = cursor.pos;
        let n_dims = cursor.u32(&format!("dimension count of {what}"))?;
        if n_dims > MAX_DIMS {
            return Err(format!(
                "{what} at byte {at} has {n_dims} dimensions (at most {MAX_DIMS})"
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let dim = cursor.u64(&format!("dimension {d} of {what}"))?;
            ne.push(
                usize::try_from(dim)
                    .map_err(|_| format!("{what} dimension {d} is {dim}, too large"))?,
            );
        }
        let checked_elements = ne.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if checked_elements.is_none_or(|n| n > i64::MAX as usize) {
            return Err(format!(
                "{what} has dimensions {ne:?} whose element count overflows"
            ));
        }
        let ggml_type = GgmlType::from_id(cursor.u32(&format!("type of {what}"))?);
        let offset = cursor.u64(&format!("data offset of {what}"))?;
        let offset = usize::try_from(offset)
            .map_err(|_| format!("{what} data offset {offset} is too large"))?;
        if let (Some((block_elems, _)), Some(&row)) = (ggml_type.block_layout(), ne.first())
            && !row.is_multiple_of(block_elems)
        {
            return Err(format!(
                "{what} has rows of {row} elements, not a multiple of the {ggml_type} block \
                 size {block_elems}"
            ));
        }
        if !seen.insert(name.clone()) {
            return Err(format!("duplicate tensor name `{name}`"));
        }
        ne.reverse();
        tensors.push(GgufTensorInfo {
            name,
            shape: ne,
            ggml_type,
            offset,
        });
    }
    Ok(tensors)
}

fn check_tensor_bounds(
    tensor: &GgufTensorInfo,
    alignment: usize,
    data_len: usize,
) -> Result<(), String> {
    let name = &tensor.name;
    if !tensor.offset.is_multiple_of(alignment) {
        return Err(format!(
            "tensor `{name}` data offset {} is not a multiple of the alignment {alignment}",
            tensor.offset
        ));
    }
    let size = tensor.byte_size().unwrap_or(0);
    match tensor.offset.checked_add(size) {
        Some(end) if end <= data_len => Ok(()),
        _ => Err(format!(
            "tensor `{name}` ({} {:?}) needs data bytes {}..{} but the data section has only \
             {data_len} \
             (file truncated?)",
            tensor.ggml_type,
            tensor.shape,
            tensor.offset,
            tensor.offset as u128 + size as u128
        )),
    }
}
