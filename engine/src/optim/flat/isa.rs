//! The instruction sets the host passes are compiled for (one copy of each pass per set: see
//! `widest!` in `vector.rs`), and what a copy does with its set beyond what the compiler
//! vectorises from plain code: converting to IEEE half precision with the CPU's own instruction
//! (`vcvtps2ph`, of F16C and AVX-512F), which rounds to nearest even as the portable conversion
//! does, in one instruction where that takes a dozen. Over 300M parameters on the 2-core
//! machine the fp16 copy cost the fused AdamW pass 0.05 to 0.06 s (of 0.25 s) converted
//! portably and 0.025 s with the instruction, what writing its 2 bytes a parameter costs.
use super::half::f16_bits;

/// Elements a pass works on together (the vector code's lanes: one AVX-512 register of `f32`).
pub(crate) const WIDTH: usize = 16;

/// An instruction set a pass's copy is compiled for.
pub(crate) trait Isa {
    /// IEEE binary16 bits of each of `x`, rounded to nearest even. NaN stays a quiet NaN with
    /// its sign (the instruction keeps the top of its payload too, as torch's vectorised
    /// conversion, which uses it, does).
    fn f16(x: &[f32; WIDTH]) -> [u16; WIDTH];
}

/// Any x86_64 (or another architecture): the portable conversion, vectorised by the compiler.
pub(crate) struct Baseline;

impl Isa for Baseline {
    #[inline(always)]
    fn f16(x: &[f32; WIDTH]) -> [u16; WIDTH] {
        portable(x, f16_bits)
    }
}

/// Each of `x` converted by `convert`, one of the portable conversions of `half.rs`, in a plain
/// loop the compiler vectorises (`array::map` and `from_fn` of a conversion were left as calls).
#[inline(always)]
pub(crate) fn portable(x: &[f32; WIDTH], convert: impl Fn(f32) -> u16) -> [u16; WIDTH] {
    let mut h = [0; WIDTH];
    h.iter_mut().zip(x).for_each(|(h, &x)| *h = convert(x));
    h
}

/// AVX2 with F16C (every CPU with AVX2 has F16C).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    #[inline(always)]
    fn f16(x: &[f32; WIDTH]) -> [u16; WIDTH] {
        // F16C's immediate has no exception bit (three bits: the rounding, and whether
        // MXCSR's rounding applies instead).
        use std::arch::x86_64::{__m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _MM_FROUND_TO_NEAREST_INT as NEAREST};
        // SAFETY: only the copies compiled for AVX2 and F16C, called where the CPU has both,
        // use this set; the loads read 8 floats from each half of `x`.
        unsafe {
            let low = _mm256_cvtps_ph::<NEAREST>(_mm256_loadu_ps(x.as_ptr()));
            let high = _mm256_cvtps_ph::<NEAREST>(_mm256_loadu_ps(x.as_ptr().add(WIDTH / 2)));
            std::mem::transmute::<[__m128i; 2], [u16; WIDTH]>([low, high])
        }
    }
}

/// AVX-512F.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Isa for Avx512 {
    #[inline(always)]
    fn f16(x: &[f32; WIDTH]) -> [u16; WIDTH] {
        use std::arch::x86_64::{
            __m256i, _mm512_cvtps_ph, _mm512_loadu_ps, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
        };
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        // SAFETY: only the copies compiled for AVX-512F, called where the CPU has it, use this
        // set; the load reads the 16 floats of `x`.
        unsafe { std::mem::transmute::<__m256i, [u16; WIDTH]>(_mm512_cvtps_ph::<NEAREST>(_mm512_loadu_ps(x.as_ptr()))) }
    }
}
