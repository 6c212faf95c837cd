//! A minimal GGUF v3 writer for tests and fixtures: metadata plus tensors given as raw
//! (already encoded) bytes.
//!
//! Follows the layout gguf-py's `GGUFWriter` produces: header, key/values, tensor infos,
//! padding to `general.alignment` (32), then each tensor's data padded to the alignment.

use std::path::Path;

use super::quant::GgmlType;
use super::value::GgufValue;
use crate::{FormatError, Result};

const ALIGNMENT: usize = 32;

struct PendingTensor {
    name: String,
    shape: Vec<usize>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes them as one GGUF file.
#[derive(Default)]
pub struct GgufBuilder {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
}

impl GgufBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn metadata(&mut self, key: &str, value: GgufValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor with a row-major `shape` (numpy order) and its encoded bytes; the bytes
    /// are written as given, so a test can store any type, or a wrong size on purpose.
    pub fn tensor(
        &mut self,
        name: &str,
        shape: &[usize],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        let shape = shape.to_vec();
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            shape,
            ggml_type,
            data,
        });
        self
    }

    /// Adds an F32 tensor.
    pub fn tensor_f32(&mut self, name: &str, shape: &[usize], values: &[f32]) -> &mut Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, shape, GgmlType::F32, data)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&type_id(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for tensor in &self.tensors {
            put_string(&mut out, &tensor.name);
            out.extend_from_slice(&(tensor.shape.len() as u32).to_le_bytes());
            for &dim in tensor.shape.iter().rev() {
                out.extend_from_slice(&(dim as u64).to_le_bytes());
            }
            out.extend_from_slice(&tensor.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + tensor.data.len()).next_multiple_of(ALIGNMENT);
        }
        out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        for tensor in &self.tensors {
            out.extend_from_slice(&tensor.data);
            out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        }
        out
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|e| FormatError::io(path, e))
    }
}

fn type_id(value: &GgufValue) -> u32 {
    match value {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(v) => put_string(out, v),
        GgufValue::Array(items) => {
            // An empty array's element type is not recoverable; uint8 is as good as any.
            let element_type = items.first().map_or(0, type_id);
            out.extend_from_slice(&element_type.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}
