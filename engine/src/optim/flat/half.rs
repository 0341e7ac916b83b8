//! The half-precision formats the host optimizer writes its weight copies in, and the portable
//! conversions to them (branch-free, so the compiler vectorises them; `isa.rs` has the CPU's
//! own fp16 instruction where there is one).

/// A half-precision format the updated weights can be written out in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// IEEE binary16 (`torch.float16`).
    F16,
    /// bfloat16 (`torch.bfloat16`).
    Bf16,
}

impl Half {
    /// `x` rounded to nearest even in this format, as torch's `.to(dtype)` of a CPU tensor
    /// rounds it (NaN becomes a quiet NaN: fp16 keeps its sign; bf16's is `0xffff`, what
    /// torch's vectorised conversion writes, where its scalar one writes `0x7fc0`).
    #[inline(always)]
    pub fn from_f32(self, x: f32) -> u16 {
        match self {
            Half::F16 => f16_bits(x),
            Half::Bf16 => bf16_bits(x),
        }
    }
}

/// IEEE binary16 bits of `x`, rounded to nearest even, without branches (so it vectorises):
/// F. Giesen's `float_to_half_fast3_rtne`.
#[inline(always)]
pub(super) fn f16_bits(x: f32) -> u16 {
    const INFINITY: u32 = 255 << 23;
    // The smallest f32 whose half is infinite (65520 rounds up to it).
    const F16_MAX: u32 = (127 + 16) << 23;
    // Adding this aligns a subnormal half's 10 bits at the bottom of the float's mantissa.
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let abs = bits ^ sign;
    let special = if abs > INFINITY { 0x7e00 } else { 0x7c00 };
    let subnormal = (f32::from_bits(abs) + f32::from_bits(DENORM_MAGIC)).to_bits().wrapping_sub(DENORM_MAGIC);
    let odd = (abs >> 13) & 1;
    let normal = abs.wrapping_add(((15u32.wrapping_sub(127)) << 23).wrapping_add(0xfff)).wrapping_add(odd) >> 13;
    let magnitude = if abs >= F16_MAX {
        special
    } else if abs < (113 << 23) {
        subnormal
    } else {
        normal
    };
    (magnitude | (sign >> 16)) as u16
}

/// bfloat16 bits of `x`, rounded to nearest even (c10's `round_to_nearest_even`; NaN as ATen's
/// vectorised conversion writes it).
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    // All ones for NaN, without a branch (so it vectorises).
    let nan = u32::from(x.is_nan()).wrapping_neg();
    (rounded | nan) as u16
}

#[cfg(test)]
pub(in crate::optim::flat) mod tests {
    use tch::{Kind, Tensor};

    use super::*;
    use crate::optim::flat::host::tests::randn;

    /// Values whose rounding is the hard part: ties at both formats' precision, the largest
    /// finite halves and their overflow boundaries, subnormals, signed zeros, infinities, NaN.
    pub(in crate::optim::flat) fn awkward() -> Vec<f32> {
        let mut x = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            1e-8,
            -3e-8,
            5.960_464_5e-8,
            2.980_232_2e-8,
            6.097_555e-5,
            6.103_515_6e-5,
            f32::MIN_POSITIVE,
            1e-40,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        // Ties and near-ties around 1 at fp16's (2^-11) and bf16's (2^-8) half-ulps.
        for ulp in [2f32.powi(-11), 2f32.powi(-8)] {
            for k in 0..8 {
                let t = 1.0 + ulp * (2 * k + 1) as f32;
                x.extend([t, -t, f32::from_bits(t.to_bits() + 1), f32::from_bits(t.to_bits() - 1)]);
            }
        }
        x.extend(randn(4000, 11).iter().map(|v| v * 1e3));
        x.extend(randn(4000, 12).iter().map(|v| v * 1e-5));
        x
    }

    #[test]
    fn half_conversions_round_as_torch() -> anyhow::Result<()> {
        let x = awkward();
        let t = Tensor::from_slice(&x);
        for (kind, torch_kind) in [(Half::F16, Kind::Half), (Half::Bf16, Kind::BFloat16)] {
            let expected = Vec::<i16>::try_from(t.f_to_kind(torch_kind)?.f_view_dtype(Kind::Int16)?)?;
            for (i, (&v, &e)) in x.iter().zip(&expected).enumerate() {
                assert_eq!(kind.from_f32(v), e as u16, "{kind:?} of {v:e} (#{i}, bits {:#x})", v.to_bits());
            }
        }
        Ok(())
    }
}
