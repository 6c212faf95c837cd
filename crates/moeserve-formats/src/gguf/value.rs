//! GGUF metadata values (`gguf_type`): the twelve scalar/string types and arrays of them.
//!
//! Follows the GGUF spec in ggml's `docs/gguf.md`; integer accessors accept any integer type
//! whose value fits, because writers differ in which width they pick for the same key.

/// One metadata value. Arrays may nest (an array of arrays).
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// The value type ids of the GGUF spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub(crate) fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        [
            U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64,
        ]
        .get(usize::try_from(id).ok()?)
        .copied()
    }

    /// The fewest bytes one value of this type takes in a file: bounds array lengths read
    /// from untrusted input before anything is allocated.
    pub(crate) fn min_encoded_size(self) -> usize {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            // element type + count
            ValueType::Array => 12,
        }
    }
}

impl GgufValue {
    /// The spec's name of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "uint8",
            GgufValue::I8(_) => "int8",
            GgufValue::U16(_) => "uint16",
            GgufValue::I16(_) => "int16",
            GgufValue::U32(_) => "uint32",
            GgufValue::I32(_) => "int32",
            GgufValue::F32(_) => "float32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "uint64",
            GgufValue::I64(_) => "int64",
            GgufValue::F64(_) => "float64",
        }
    }

    /// Any integer type, as i128 so every stored value fits exactly.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A float, or an integer read as a float.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_integer().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_accessors_accept_every_width() {
        assert_eq!(GgufValue::U8(7).as_integer(), Some(7));
        assert_eq!(GgufValue::I64(-3).as_integer(), Some(-3));
        assert_eq!(GgufValue::U64(u64::MAX).as_integer(), Some(u64::MAX.into()));
        assert_eq!(GgufValue::F32(1.0).as_integer(), None);
        assert_eq!(GgufValue::U32(5).as_f64(), Some(5.0));
    }

    #[test]
    fn value_type_ids_follow_the_spec() {
        assert_eq!(ValueType::from_id(8), Some(ValueType::String));
        assert_eq!(ValueType::from_id(12), Some(ValueType::F64));
        assert_eq!(ValueType::from_id(13), None);
    }
}
