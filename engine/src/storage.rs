//! Releasing a tensor's memory in place and bringing it back: the storage is resized, so every
//! tensor viewing it (parameters that are views into a chunk, and the views autograd saved for
//! backward) keeps its identity and sees the memory go and come back. Gemini's chunks use this
//! to free parameters between uses without rebuilding the model or the autograd graph.
use tch::Tensor;

use crate::ffi::{self, check, RawTensor};
use crate::Result;

/// Bytes currently held by `t`'s storage (0 once released).
pub fn storage_bytes(t: &Tensor) -> Result<usize> {
    let mut out = 0i64;
    check(unsafe { ffi::eng_storage_nbytes(t.raw(), &mut out) }, || "reading a storage size".into())?;
    Ok(out as usize)
}

/// Resizes `t`'s storage to `bytes`, freeing it with 0. Growing allocates new memory whose
/// contents are unspecified (the caller fills it); every view of the storage sees the change.
pub fn resize_storage(t: &Tensor, bytes: usize) -> Result<()> {
    check(unsafe { ffi::eng_storage_resize(t.raw(), bytes as i64) }, || format!("resizing a storage to {bytes} bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn views_follow_the_storage_out_and_back() {
        let base = Tensor::arange(6, (Kind::Float, Device::Cpu));
        let view = base.narrow(0, 2, 3);
        assert_eq!(storage_bytes(&view).unwrap(), 24);
        resize_storage(&base, 0).unwrap();
        assert_eq!(storage_bytes(&view).unwrap(), 0, "the view's storage is the same storage");
        resize_storage(&base, 24).unwrap();
        tch::no_grad(|| base.shallow_clone().copy_(&Tensor::from_slice(&[9.0f32, 8., 7., 6., 5., 4.])));
        assert_eq!(Vec::<f32>::try_from(&view).unwrap(), vec![7.0, 6.0, 5.0]);
    }

    #[test]
    fn autograd_sees_the_memory_brought_back() {
        // A weight saved for backward through a view, released after forward and restored
        // (with the same values) before backward, gives the ordinary gradient.
        let chunk = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
        let w = chunk.narrow(0, 0, 4).view([2, 2]).detach().set_requires_grad(true);
        let x = Tensor::from_slice(&[1.0f32, -1.0]).view([1, 2]);
        let y = x.matmul(&w.tr()).sum(Kind::Float);
        let saved: Vec<f32> = Vec::try_from(w.flatten(0, -1)).unwrap();
        resize_storage(&w, 0).unwrap();
        resize_storage(&w, 16).unwrap();
        tch::no_grad(|| w.shallow_clone().copy_(&Tensor::from_slice(&saved).view([2, 2])));
        y.backward();
        assert_eq!(Vec::<f32>::try_from(w.grad().flatten(0, -1)).unwrap(), vec![1.0, -1.0, 1.0, -1.0]);
    }
}
