//! ggml tensor types and their dequantisation to f32.
//!
//! Follows ggml's `ggml-quants.c` and gguf-py's `quants.py` bit for bit: every block is decoded
//! in f32 with the same operation order (`d * q + m`, never fused), so the result equals what
//! `gguf.quants.dequantize` returns. Only the types moeserve converts are decoded: F32, F16,
//! BF16, Q8_0, Q4_0 and Q4_1; the others are known by name and size so a file that holds them
//! can still be opened and reported clearly.

use half::{bf16, f16};

/// A ggml tensor type id as stored in a GGUF tensor info (`ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    BF16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
    /// An id this reader does not know; its size is unknown too.
    Unknown(u32),
}

/// `(id, type, elements per block, bytes per block, name)`, as ggml's `type_traits`.
const TYPE_TABLE: &[(u32, GgmlType, usize, usize, &str)] = &[
    (0, GgmlType::F32, 1, 4, "F32"),
    (1, GgmlType::F16, 1, 2, "F16"),
    (2, GgmlType::Q4_0, 32, 18, "Q4_0"),
    (3, GgmlType::Q4_1, 32, 20, "Q4_1"),
    (6, GgmlType::Q5_0, 32, 22, "Q5_0"),
    (7, GgmlType::Q5_1, 32, 24, "Q5_1"),
    (8, GgmlType::Q8_0, 32, 34, "Q8_0"),
    (9, GgmlType::Q8_1, 32, 40, "Q8_1"),
    (10, GgmlType::Q2K, 256, 84, "Q2_K"),
    (11, GgmlType::Q3K, 256, 110, "Q3_K"),
    (12, GgmlType::Q4K, 256, 144, "Q4_K"),
    (13, GgmlType::Q5K, 256, 176, "Q5_K"),
    (14, GgmlType::Q6K, 256, 210, "Q6_K"),
    (15, GgmlType::Q8K, 256, 292, "Q8_K"),
    (16, GgmlType::Iq2Xxs, 256, 66, "IQ2_XXS"),
    (17, GgmlType::Iq2Xs, 256, 74, "IQ2_XS"),
    (18, GgmlType::Iq3Xxs, 256, 98, "IQ3_XXS"),
    (19, GgmlType::Iq1S, 256, 50, "IQ1_S"),
    (20, GgmlType::Iq4Nl, 32, 18, "IQ4_NL"),
    (21, GgmlType::Iq3S, 256, 110, "IQ3_S"),
    (22, GgmlType::Iq2S, 256, 82, "IQ2_S"),
    (23, GgmlType::Iq4Xs, 256, 136, "IQ4_XS"),
    (24, GgmlType::I8, 1, 1, "I8"),
    (25, GgmlType::I16, 1, 2, "I16"),
    (26, GgmlType::I32, 1, 4, "I32"),
    (27, GgmlType::I64, 1, 8, "I64"),
    (28, GgmlType::F64, 1, 8, "F64"),
    (29, GgmlType::Iq1M, 256, 56, "IQ1_M"),
    (30, GgmlType::BF16, 1, 2, "BF16"),
    (34, GgmlType::Tq1_0, 256, 54, "TQ1_0"),
    (35, GgmlType::Tq2_0, 256, 66, "TQ2_0"),
    (39, GgmlType::Mxfp4, 32, 17, "MXFP4"),
];

/// The types `dequantize_into` decodes, for error messages.
pub(crate) const SUPPORTED: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1";

/// Elements per block of the block-quantised types decoded here (ggml's `QK4_0` etc.).
const QK: usize = 32;

impl GgmlType {
    pub fn from_id(id: u32) -> GgmlType {
        TYPE_TABLE
            .iter()
            .find(|entry| entry.0 == id)
            .map_or(GgmlType::Unknown(id), |entry| entry.1)
    }

    fn entry(self) -> Option<&'static (u32, GgmlType, usize, usize, &'static str)> {
        TYPE_TABLE.iter().find(|entry| entry.1 == self)
    }

    /// The numeric id stored in GGUF files.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::Unknown(id) => id,
            known => known.entry().map_or(u32::MAX, |entry| entry.0),
        }
    }

    /// `(elements per block, bytes per block)`, or `None` for an unknown id.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        self.entry().map(|entry| (entry.2, entry.3))
    }

    /// Bytes taken by `num_elements` elements, or `None` when the type is unknown, the count
    /// is not a whole number of blocks, or the size overflows.
    pub fn byte_size(self, num_elements: usize) -> Option<usize> {
        let (block_elems, block_bytes) = self.block_layout()?;
        if !num_elements.is_multiple_of(block_elems) {
            return None;
        }
        (num_elements / block_elems).checked_mul(block_bytes)
    }

    /// Whether [`dequantize_into`] decodes this type.
    pub fn can_dequantize(self) -> bool {
        // Keep in step with the decoders in `dequantize_into` and `SUPPORTED`.
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q8_0
                | GgmlType::Q4_0
                | GgmlType::Q4_1
        )
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.entry() {
            Some(entry) => f.write_str(entry.4),
            None => write!(f, "unknown ggml type {}", self.id()),
        }
    }
}

/// Decodes `data` (whole blocks of `ty`) into `out`, one f32 per element.
///
/// The error says what is wrong (unsupported type, or a length that does not match); callers
/// add the file and tensor name.
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), String> {
    let decode: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |data, out| decode_scalars::<4>(data, out, f32::from_le_bytes),
        GgmlType::F16 => {
            |data, out| decode_scalars::<2>(data, out, |b| f16::from_le_bytes(b).to_f32())
        }
        GgmlType::BF16 => {
            |data, out| decode_scalars::<2>(data, out, |b| bf16::from_le_bytes(b).to_f32())
        }
        GgmlType::Q8_0 => |data, out| decode_blocks(data, out, 34, dequantize_q8_0_block),
        GgmlType::Q4_0 => |data, out| decode_blocks(data, out, 18, dequantize_q4_0_block),
        GgmlType::Q4_1 => |data, out| decode_blocks(data, out, 20, dequantize_q4_1_block),
        _ => {
            return Err(format!(
                "tensor type {ty} cannot be dequantised (supported: {SUPPORTED})"
            ));
        }
    };
    let expected = ty.byte_size(out.len());
    if expected != Some(data.len()) {
        return Err(format!(
            "{} elements of {ty} need {} bytes, got {}",
            out.len(),
            expected.map_or_else(
                || "a whole number of blocks and".to_string(),
                |n| n.to_string()
            ),
            data.len()
        ));
    }
    decode(data, out);
    Ok(())
}

/// Decodes a whole buffer of `ty` and returns the values.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>, String> {
    let (block_elems, block_bytes) = ty
        .block_layout()
        .ok_or_else(|| format!("tensor type {ty} has no known block size"))?;
    if !data.len().is_multiple_of(block_bytes) {
        return Err(format!(
            "{} bytes is not a whole number of {ty} blocks ({block_bytes} bytes each)",
            data.len()
        ));
    }
    let mut out = vec![0.0f32; data.len() / block_bytes * block_elems];
    dequantize_into(ty, data, &mut out)?;
    Ok(out)
}

fn decode_scalars<const N: usize>(data: &[u8], out: &mut [f32], decode: impl Fn([u8; N]) -> f32) {
    for (value, bytes) in out.iter_mut().zip(data.as_chunks::<N>().0) {
        *value = decode(*bytes);
    }
}

fn decode_blocks(data: &[u8], out: &mut [f32], block_bytes: usize, decode: fn(&[u8], &mut [f32])) {
    for (values, block) in out.chunks_exact_mut(QK).zip(data.chunks_exact(block_bytes)) {
        decode(block, values);
    }
}

fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// `block_q8_0 { f16 d; int8 qs[32]; }`: `x = qs * d`.
fn dequantize_q8_0_block(block: &[u8], out: &mut [f32]) {
    let d = read_f16(block, 0);
    for (value, &q) in out.iter_mut().zip(&block[2..]) {
        *value = f32::from(q as i8) * d;
    }
}

/// `block_q4_0 { f16 d; u8 qs[16]; }`: low nibbles are elements 0..16, high nibbles 16..32,
/// `x = (nibble - 8) * d`.
fn dequantize_q4_0_block(block: &[u8], out: &mut [f32]) {
    let d = read_f16(block, 0);
    let (low, high) = out.split_at_mut(QK / 2);
    for (j, &q) in block[2..].iter().enumerate() {
        low[j] = d * f32::from((q & 0x0F) as i8 - 8);
        high[j] = d * f32::from((q >> 4) as i8 - 8);
    }
}

/// `block_q4_1 { f16 d; f16 m; u8 qs[16]; }`: `x = d * nibble + m`, low nibbles first.
fn dequantize_q4_1_block(block: &[u8], out: &mut [f32]) {
    let d = read_f16(block, 0);
    let m = read_f16(block, 2);
    let (low, high) = out.split_at_mut(QK / 2);
    for (j, &q) in block[4..].iter().enumerate() {
        low[j] = d * f32::from(q & 0x0F) + m;
        high[j] = d * f32::from(q >> 4) + m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q4_1_block(d: f32, m: f32, nibbles: [u8; 32]) -> Vec<u8> {
        let mut block = Vec::new();
        block.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        block.extend_from_slice(&f16::from_f32(m).to_le_bytes());
        for j in 0..16 {
            block.push(nibbles[j] | (nibbles[j + 16] << 4));
        }
        block
    }

    #[test]
    fn q4_1_puts_low_nibbles_first_and_adds_the_minimum() {
        let nibbles: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
        let block = q4_1_block(0.5, -2.0, nibbles);
        let values = dequantize(GgmlType::Q4_1, &block).expect("one whole block");
        let expected: Vec<f32> = nibbles.iter().map(|&q| 0.5 * f32::from(q) - 2.0).collect();
        assert_eq!(values, expected);
    }

    #[test]
    fn q4_0_centres_nibbles_on_eight() {
        let mut block = f16::from_f32(2.0).to_le_bytes().to_vec();
        block.extend(std::iter::repeat_n(0x80u8, 16));
        let values = dequantize(GgmlType::Q4_0, &block).expect("one whole block");
        assert!(values[..16].iter().all(|&v| v == -16.0));
        assert!(values[16..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn q8_0_reads_signed_quants() {
        let mut block = f16::from_f32(0.25).to_le_bytes().to_vec();
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let values = dequantize(GgmlType::Q8_0, &block).expect("one whole block");
        let expected: Vec<f32> = (0..32).map(|i| (i - 16) as f32 * 0.25).collect();
        assert_eq!(values, expected);
    }

    #[test]
    fn scalar_types_decode_little_endian() {
        let bytes = [1.5f32.to_le_bytes(), (-3.0f32).to_le_bytes()].concat();
        assert_eq!(
            dequantize(GgmlType::F32, &bytes).expect("f32"),
            vec![1.5, -3.0]
        );
        let bytes = bf16::from_f32(-0.75).to_le_bytes();
        assert_eq!(
            dequantize(GgmlType::BF16, &bytes).expect("bf16"),
            vec![-0.75]
        );
        let bytes = f16::from_f32(6.5).to_le_bytes();
        assert_eq!(dequantize(GgmlType::F16, &bytes).expect("f16"), vec![6.5]);
    }

    #[test]
    fn unsupported_type_is_named_in_the_error() {
        let err = dequantize(GgmlType::Q4K, &[0u8; 144]).expect_err("Q4_K is not decoded");
        assert!(err.contains("Q4_K"), "{err}");
    }

    #[test]
    fn length_mismatch_is_an_error_not_a_panic() {
        let mut out = [0.0f32; 32];
        let err = dequantize_into(GgmlType::Q4_1, &[0u8; 19], &mut out).expect_err("short block");
        assert!(err.contains("need 20 bytes"), "{err}");
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 35]).is_err());
    }

    #[test]
    fn type_ids_round_trip() {
        for id in 0..40 {
            assert_eq!(GgmlType::from_id(id).id(), id);
        }
        assert_eq!(GgmlType::from_id(3), GgmlType::Q4_1);
        assert_eq!(GgmlType::from_id(99).to_string(), "unknown ggml type 99");
    }
}
