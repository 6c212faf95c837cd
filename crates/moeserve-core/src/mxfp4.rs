//! OCP MXFP4's element and scale (the gpt-oss release's experts): e2m1 values, two per byte,
//! and an e8m0 scale per 32 elements of a row.

/// Elements per scale.
pub const BLOCK: usize = 32;

/// e2m1 by code: bit 3 the sign, then a 2-bit exponent (bias 1) and a 1-bit mantissa.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The e8m0 scale `2^(e - 127)`: the exponent bits alone, and `2^-127` (subnormal in f32) for
/// 0. 255 is e8m0's NaN, which readers refuse.
pub fn e8m0(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits(u32::from(e) << 23),
    }
}
