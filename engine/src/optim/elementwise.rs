//! The arithmetic the optimizer rules are written in, so each rule is written once and runs on
//! one `f32` at a time (the flat host kernels) or on whole tensors (the tensor optimizers and
//! the flat device executor).
//!
//! Each method is one rounded operation (one torch kernel on tensors; Rust does not fuse `f32`
//! multiply-adds), so a rule's host and tensor forms round alike, step for step. Scalars are
//! computed in f64 and converted once to the operand's [`Elementwise::Scalar`]: `f32` on the
//! host; on tensors the f64 itself, which torch casts to the tensor's precision (for the f32
//! flat buffers, the same `f32` the host uses).
use std::convert::Infallible;

use tch::Tensor;

use crate::Result;

/// A scalar a rule multiplies by, converted once from the f64 it is computed in.
pub(crate) trait Scalar: Copy + Send + Sync {
    /// `x` in this precision.
    fn from_f64(x: f64) -> Self;
    /// Whether this is exactly 1 (dividing by it changes nothing).
    fn is_one(self) -> bool;
}

impl Scalar for f32 {
    #[inline(always)]
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    fn is_one(self) -> bool {
        self == 1.0
    }
}

impl Scalar for f64 {
    #[inline(always)]
    fn from_f64(x: f64) -> f64 {
        x
    }
    fn is_one(self) -> bool {
        self == 1.0
    }
}

/// Values a rule computes on: out-of-place operations return a new value, `*_` ones write into
/// `self` (a weight or a state buffer, in place).
pub(crate) trait Elementwise: Sized {
    /// What the value is multiplied by.
    type Scalar: Scalar;
    /// What an operation can fail with (nothing, for `f32`).
    type Error;
    /// `x * s`.
    fn scale(&self, s: Self::Scalar) -> std::result::Result<Self, Self::Error>;
    /// `x / s`.
    fn div_scalar(&self, s: Self::Scalar) -> std::result::Result<Self, Self::Error>;
    /// `x + s`.
    fn add_scalar(&self, s: Self::Scalar) -> std::result::Result<Self, Self::Error>;
    /// `x + y`.
    fn add(&self, y: &Self) -> std::result::Result<Self, Self::Error>;
    /// `x * y`.
    fn mul(&self, y: &Self) -> std::result::Result<Self, Self::Error>;
    /// `x / y`.
    fn div(&self, y: &Self) -> std::result::Result<Self, Self::Error>;
    /// `sqrt(x)`.
    fn sqrt(&self) -> std::result::Result<Self, Self::Error>;
    /// The same values (a copy of an `f32`, another handle to a tensor).
    fn share(&self) -> Self;
    /// `x = x * s`.
    fn scale_(&mut self, s: Self::Scalar) -> std::result::Result<(), Self::Error>;
    /// `x = x * s + y`.
    fn scale_add_(&mut self, s: Self::Scalar, y: &Self) -> std::result::Result<(), Self::Error>;
    /// `x = x - y`.
    fn sub_(&mut self, y: &Self) -> std::result::Result<(), Self::Error>;
    /// `x = y`.
    fn assign(&mut self, y: &Self) -> std::result::Result<(), Self::Error>;
}

impl Elementwise for f32 {
    type Scalar = f32;
    type Error = Infallible;

    #[inline(always)]
    fn scale(&self, s: f32) -> std::result::Result<f32, Infallible> {
        Ok(self * s)
    }
    #[inline(always)]
    fn div_scalar(&self, s: f32) -> std::result::Result<f32, Infallible> {
        Ok(self / s)
    }
    #[inline(always)]
    fn add_scalar(&self, s: f32) -> std::result::Result<f32, Infallible> {
        Ok(self + s)
    }
    #[inline(always)]
    fn add(&self, y: &f32) -> std::result::Result<f32, Infallible> {
        Ok(self + y)
    }
    #[inline(always)]
    fn mul(&self, y: &f32) -> std::result::Result<f32, Infallible> {
        Ok(self * y)
    }
    #[inline(always)]
    fn div(&self, y: &f32) -> std::result::Result<f32, Infallible> {
        Ok(self / y)
    }
    #[inline(always)]
    fn sqrt(&self) -> std::result::Result<f32, Infallible> {
        Ok(f32::sqrt(*self))
    }
    #[inline(always)]
    fn share(&self) -> f32 {
        *self
    }
    #[inline(always)]
    fn scale_(&mut self, s: f32) -> std::result::Result<(), Infallible> {
        *self *= s;
        Ok(())
    }
    #[inline(always)]
    fn scale_add_(&mut self, s: f32, y: &f32) -> std::result::Result<(), Infallible> {
        *self = *self * s + y;
        Ok(())
    }
    #[inline(always)]
    fn sub_(&mut self, y: &f32) -> std::result::Result<(), Infallible> {
        *self -= y;
        Ok(())
    }
    #[inline(always)]
    fn assign(&mut self, y: &f32) -> std::result::Result<(), Infallible> {
        *self = *y;
        Ok(())
    }
}

impl Elementwise for Tensor {
    type Scalar = f64;
    type Error = crate::Error;

    fn scale(&self, s: f64) -> Result<Tensor> {
        Ok(self.f_mul_scalar(s)?)
    }
    fn div_scalar(&self, s: f64) -> Result<Tensor> {
        Ok(self.f_div_scalar(s)?)
    }
    fn add_scalar(&self, s: f64) -> Result<Tensor> {
        Ok(self.f_add_scalar(s)?)
    }
    fn add(&self, y: &Tensor) -> Result<Tensor> {
        Ok(self.f_add(y)?)
    }
    fn mul(&self, y: &Tensor) -> Result<Tensor> {
        Ok(self.f_mul(y)?)
    }
    fn div(&self, y: &Tensor) -> Result<Tensor> {
        Ok(self.f_div(y)?)
    }
    fn sqrt(&self) -> Result<Tensor> {
        Ok(self.f_sqrt()?)
    }
    fn share(&self) -> Tensor {
        self.shallow_clone()
    }
    fn scale_(&mut self, s: f64) -> Result<()> {
        let _ = self.f_mul_scalar_(s)?;
        Ok(())
    }
    fn scale_add_(&mut self, s: f64, y: &Tensor) -> Result<()> {
        let _ = self.f_mul_scalar_(s)?.f_add_(y)?;
        Ok(())
    }
    fn sub_(&mut self, y: &Tensor) -> Result<()> {
        let _ = self.f_sub_(y)?;
        Ok(())
    }
    fn assign(&mut self, y: &Tensor) -> Result<()> {
        self.f_copy_(y)?;
        Ok(())
    }
}
