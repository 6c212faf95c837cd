//! What an AMX core does per instruction here: `TDPBF16PS` (16 × 32 by 32 × 16 bf16 into
//! 16 × 16 f32) in independent and dependent chains, and a 1 KiB `TILELOADD` from L1 before
//! each one — the numbers a bf16 AMX kernel's blocking is planned from (see bench/RESULTS.md).
//!
//!   cargo run --release -p moeserve-backend --example amx_probe
//!
//! Says so and exits 0 where the CPU has no AMX-BF16 or Linux does not grant the tile state.

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::arch::asm;
    use std::time::Instant;

    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
        println!("no AMX-BF16 on this CPU");
        return;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    if unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    } != 0
    {
        println!("Linux does not grant this process the AMX tile state");
        return;
    }
    #[repr(C, align(64))]
    struct Config([u8; 64]);
    let mut config = Config([0; 64]);
    config.0[0] = 1; // palette 1: eight tiles of 16 rows × 64 bytes
    for t in 0..8 {
        config.0[16 + 2 * t] = 64;
        config.0[48 + t] = 16;
    }
    // 32 tiles of zeros (bf16 and f32 zero): 32 KiB, in L1 after the first pass.
    let tiles = vec![0u8; 32 << 10];
    let tile = |i: u64| tiles.as_ptr().wrapping_add((i as usize % 32) << 10);
    // SAFETY: the tile state is granted and the configuration valid; every load reads 16
    // rows of 64 bytes inside `tiles`.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack));
        asm!(
            "tileloadd tmm6, [{b} + {s}*1]",
            "tileloadd tmm7, [{b} + {s}*1]",
            b = in(reg) tile(0), s = in(reg) 64usize, options(nostack)
        );
    }
    let rounds = 1_000_000u64;
    // Times `rounds` runs of one asm block of `$per` multiplies (operands: `{b}` the round's
    // tile, `{c}` the next one, `{s}` the row stride) and prints the time per multiply. asm!
    // refuses operands a template does not name, so blocks that use fewer name the rest in an
    // assembler comment.
    macro_rules! per_multiply {
        ($what:expr, $per:expr, $($line:literal),+) => {{
            let start = Instant::now();
            for i in 0..rounds {
                // SAFETY: the tiles are configured and tmm6/tmm7 loaded above; every load
                // reads one 1 KiB tile of `tiles`.
                unsafe {
                    asm!(
                        $($line),+,
                        b = in(reg) tile(i), c = in(reg) tile(i + 1), s = in(reg) 64usize,
                        options(nostack)
                    )
                };
            }
            let ns = start.elapsed().as_secs_f64() * 1e9 / (rounds * $per) as f64;
            // 16 × 16 outputs × 32 products, 2 FLOPs each.
            println!("{}: {ns:.2} ns per TDPBF16PS ({:.0} GFLOP/s)", $what, 16384.0 / ns);
        }};
    }
    per_multiply!(
        "4 independent sums",
        4,
        "tdpbf16ps tmm0, tmm6, tmm7",
        "tdpbf16ps tmm1, tmm6, tmm7",
        "tdpbf16ps tmm2, tmm6, tmm7",
        "tdpbf16ps tmm3, tmm6, tmm7",
        "/* {b} {c} {s} */"
    );
    per_multiply!(
        "one dependent sum",
        4,
        "tdpbf16ps tmm0, tmm6, tmm7",
        "tdpbf16ps tmm0, tmm6, tmm7",
        "tdpbf16ps tmm0, tmm6, tmm7",
        "tdpbf16ps tmm0, tmm6, tmm7",
        "/* {b} {c} {s} */"
    );
    per_multiply!(
        "a 1 KiB tile load (L1) before each",
        2,
        "tileloadd tmm6, [{b} + {s}*1]",
        "tdpbf16ps tmm0, tmm6, tmm7",
        "tileloadd tmm5, [{b} + {s}*1]",
        "tdpbf16ps tmm1, tmm5, tmm7",
        "/* {c} */"
    );
    per_multiply!(
        "a tile load per two",
        4,
        "tileloadd tmm6, [{b} + {s}*1]",
        "tdpbf16ps tmm0, tmm6, tmm7",
        "tdpbf16ps tmm1, tmm6, tmm7",
        "tileloadd tmm5, [{b} + {s}*1]",
        "tdpbf16ps tmm2, tmm5, tmm7",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "/* {c} */"
    );
    // Each multiply reads tiles loaded one step earlier (two sets of registers), so a load
    // has a step's multiplies to arrive behind.
    per_multiply!(
        "a tile load before each, one step ahead",
        4,
        "tileloadd tmm4, [{b} + {s}*1]",
        "tileloadd tmm5, [{b} + {s}*1]",
        "tdpbf16ps tmm0, tmm6, tmm7",
        "tdpbf16ps tmm1, tmm7, tmm6",
        "tileloadd tmm6, [{c} + {s}*1]",
        "tileloadd tmm7, [{c} + {s}*1]",
        "tdpbf16ps tmm2, tmm4, tmm5",
        "tdpbf16ps tmm3, tmm5, tmm4"
    );
    // SAFETY: releases this thread's tiles.
    unsafe { asm!("tilerelease", options(nostack)) };
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("AMX is x86-64 only");
}
