//! How CUDA matrix products compute on fp32 inputs (`--fp32-matmul`): on TF32 tensor cores
//! (inputs rounded to a 10-bit mantissa, fp32 accumulation; several times the IEEE rate on
//! Ampere and later GPUs, as JAX's default precision runs fp32 products there) or in IEEE fp32
//! (libtorch's default). The setting is global to the process; [`IeeeScope`] holds a calling
//! thread to IEEE fp32 whatever it says, for the products whose precision matters more than
//! their speed (coordinate geometry). Only cuBLAS reads either: CPU products are always IEEE,
//! so on a machine without a GPU both only set flags.
use crate::ffi::{self, check};
use crate::Result;

/// The precision of fp32 matrix products on CUDA devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fp32Matmul {
    /// TF32 tensor cores, fp32 accumulation.
    Tf32,
    /// IEEE fp32 throughout.
    Ieee,
}

impl Fp32Matmul {
    /// The flag's name for it (`tf32`, `ieee`).
    pub fn name(self) -> &'static str {
        match self {
            Fp32Matmul::Tf32 => "tf32",
            Fp32Matmul::Ieee => "ieee",
        }
    }
}

/// Sets the process's precision of fp32 CUDA products (every thread, from the next product).
pub fn set(precision: Fp32Matmul) -> Result<()> {
    let on = i32::from(precision == Fp32Matmul::Tf32);
    check(unsafe { ffi::eng_set_tf32_matmul(on) }, || format!("setting fp32 matrix products to {}", precision.name()))
}

/// The process's precision of fp32 CUDA products (what [`set`] last set; libtorch starts at IEEE).
pub fn current() -> Result<Fp32Matmul> {
    let mut on = 0;
    check(unsafe { ffi::eng_tf32_matmul(&mut on) }, || "reading the precision of fp32 matrix products".into())?;
    Ok(if on != 0 { Fp32Matmul::Tf32 } else { Fp32Matmul::Ieee })
}

/// While alive, the fp32 CUDA products this thread launches are IEEE (libtorch's
/// `NoTF32Guard`); scopes nest. Thread-bound, so neither `Send` nor `Sync`. A backward pass
/// runs on autograd's own device threads, which it does not reach.
pub struct IeeeScope {
    raw: *mut std::ffi::c_void,
}

impl IeeeScope {
    /// Holds this thread's fp32 products to IEEE until the scope drops. Infallible but for
    /// the guard's one-byte allocation, whose failure aborts as Rust's own allocations do.
    pub fn enter() -> IeeeScope {
        let raw = unsafe { ffi::eng_ieee_scope_enter() };
        if raw.is_null() {
            std::alloc::handle_alloc_error(std::alloc::Layout::new::<bool>());
        }
        IeeeScope { raw }
    }

    /// Whether an [`IeeeScope`] holds this thread now.
    pub fn in_force() -> bool {
        unsafe { ffi::eng_ieee_scope_in_force() != 0 }
    }
}

impl Drop for IeeeScope {
    fn drop(&mut self) {
        // SAFETY: `raw` came from eng_ieee_scope_enter on this thread (the type is !Send) and
        // is freed once.
        unsafe { ffi::eng_ieee_scope_exit(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the setting is the process's, and tests run on parallel threads.
    #[test]
    fn the_setting_reads_back_and_scopes_hold_only_their_thread() {
        let before = current().unwrap();
        assert_eq!(before, Fp32Matmul::Ieee, "libtorch starts at IEEE");
        set(Fp32Matmul::Tf32).unwrap();
        assert_eq!(current().unwrap(), Fp32Matmul::Tf32);

        assert!(!IeeeScope::in_force());
        let outer = IeeeScope::enter();
        assert!(IeeeScope::in_force());
        assert!(!std::thread::spawn(IeeeScope::in_force).join().unwrap(), "another thread is not held");
        let inner = IeeeScope::enter();
        drop(inner);
        assert!(IeeeScope::in_force(), "the inner scope's end leaves the outer one holding");
        drop(outer);
        assert!(!IeeeScope::in_force());
        // The scope does not change the process's setting, only this thread's products.
        assert_eq!(current().unwrap(), Fp32Matmul::Tf32);

        set(Fp32Matmul::Ieee).unwrap();
        assert_eq!(current().unwrap(), Fp32Matmul::Ieee);
    }
}
