//! Where a kernel runs and how it gets there: on a CUDA device, loaded once per device into
//! the device's primary context (the one libtorch uses) and launched on libtorch's current
//! stream of that device with the tensors' own memory; or on the CPU emulator.
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result as cu, sys};

use crate::kernel::{Args, Kernel};
use crate::nvrtc::nvrtc;
use crate::{Error, Result};

/// Where a launch runs: a CUDA device, or the CPU emulator (tests without a GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Cuda(usize),
    Emulator,
}

impl Target {
    /// Where a launch on tensors of `device` runs, if anywhere: CUDA devices, and the CPU once
    /// the emulator is enabled.
    pub(crate) fn of(device: tch::Device) -> Option<Target> {
        match device {
            tch::Device::Cuda(d) => Some(Target::Cuda(d)),
            tch::Device::Cpu if crate::emulator::enabled() => Some(Target::Emulator),
            _ => None,
        }
    }

    /// The device of the tensors a launch here takes.
    pub(crate) fn device(self) -> tch::Device {
        match self {
            Target::Cuda(d) => tch::Device::Cuda(d),
            Target::Emulator => tch::Device::Cpu,
        }
    }
}

impl Kernel {
    /// Launches `function` at `target`: on the current stream of a CUDA device, or on the CPU
    /// emulator. Crate-private: the arguments must match the kernel's signature, which each
    /// operation's wrapper guarantees.
    pub(crate) fn launch(
        &self,
        function: &str,
        target: Target,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut Args,
    ) -> Result<()> {
        crate::error::ensure!(grid.0 > 0 && grid.1 > 0 && grid.2 > 0, "{function}: empty launch grid {grid:?}");
        let device = match target {
            Target::Cuda(device) => device,
            Target::Emulator => return crate::emulator::launch(self, function, grid, block, args),
        };
        let (ctx, f) = self.function(function, device)?;
        let stream = engine::cuda::Stream::current(device)?;
        let mut params = args.slots();
        let _current = ContextGuard::push(ctx)?;
        // SAFETY: the function comes from a module loaded in `ctx`, the arguments match its
        // signature (each kernel's wrapper builds them), and every pointer is a live tensor's
        // memory on this device, kept alive by the caller until the stream runs the kernel
        // (libtorch's caching allocator does not reuse memory on the same stream before then).
        unsafe { cu::launch_kernel(f, grid, (block, 1, 1), 0, stream.raw_handle() as sys::CUstream, &mut params) }
            .map_err(|e| Error::driver(format!("launching {}::{function} on cuda:{device}", self.name), e))
    }

    /// How many blocks of `block` threads of `function` `target` runs at once: on a CUDA
    /// device its multiprocessors times the blocks of the function each holds (the driver's
    /// occupancy calculator, asked once per function and block size); on the emulator
    /// [`EMULATED_RESIDENT_BLOCKS`]. A grid-stride kernel launched with this many blocks keeps
    /// the device full without a second wave.
    pub(crate) fn resident_blocks(&self, function: &str, target: Target, block: u32) -> Result<u32> {
        let device = match target {
            Target::Cuda(device) => device,
            Target::Emulator => return Ok(EMULATED_RESIDENT_BLOCKS),
        };
        self.with_loaded(device, |module| {
            if let Some(&n) = module.resident.get(&(function.to_string(), block)) {
                return Ok(n);
            }
            let f = module.function(self.name, function)?;
            let _current = ContextGuard::push(module.ctx)?;
            // SAFETY: a function of a module loaded in the pushed context.
            let per_sm = unsafe { cu::occupancy::max_active_block_per_multiprocessor(f, block as i32, 0) }
                .map_err(|e| Error::driver(format!("occupancy of {}::{function}", self.name), e))?;
            let n = (per_sm.max(1) as u32).saturating_mul(module.multiprocessors);
            module.resident.insert((function.to_string(), block), n);
            Ok(n)
        })
    }

    /// The function's handle on `device`, loading the module on first use.
    fn function(&self, function: &str, device: usize) -> Result<(sys::CUcontext, sys::CUfunction)> {
        self.with_loaded(device, |module| Ok((module.ctx, module.function(self.name, function)?)))
    }

    /// Runs `f` on this kernel's module on `device`, loading it on first use.
    fn with_loaded<R>(&self, device: usize, f: impl FnOnce(&mut Loaded) -> Result<R>) -> Result<R> {
        static LOADED: OnceLock<Mutex<HashMap<(&'static str, usize), Loaded>>> = OnceLock::new();
        let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        let module = match loaded.entry((self.name, device)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.load(device)?),
        };
        f(module)
    }

    fn load(&self, device: usize) -> Result<Loaded> {
        let dev = Device::get(device)?;
        crate::error::ensure!(
            dev.arch >= self.min_arch,
            "{}: needs a GPU of compute capability {}.{} or later; cuda:{device} is {}.{}",
            self.name,
            self.min_arch / 10,
            self.min_arch % 10,
            dev.arch / 10,
            dev.arch % 10
        );
        let ptx = self.ptx(nvrtc()?.target_for(dev.arch)?)?;
        let ptx = CString::new(ptx).map_err(|_| Error::invalid(format!("{}: PTX with a NUL byte", self.name)))?;
        let _current = ContextGuard::push(dev.ctx)?;
        // SAFETY: a NUL-terminated PTX image, loaded into the pushed context.
        let module = unsafe { cu::module::load_data(ptx.as_ptr() as *const c_void) }
            .map_err(|e| Error::driver(format!("loading {} on cuda:{device}", self.name), e))?;
        let mut functions = HashMap::new();
        for &name in self.functions {
            // SAFETY: the module was just loaded and is never unloaded.
            let f = unsafe { cu::module::get_function(module, CString::new(name).expect("a kernel name")) }
                .map_err(|e| Error::driver(format!("finding {}::{name}", self.name), e))?;
            functions.insert(name.to_string(), f);
        }
        Ok(Loaded { ctx: dev.ctx, functions, multiprocessors: dev.multiprocessors, resident: HashMap::new() })
    }
}

/// What [`Kernel::resident_blocks`] gives on the emulator: a few blocks, so that the tests take
/// grid-stride loops round several times, over 768 threads (not a power of two).
pub(crate) const EMULATED_RESIDENT_BLOCKS: u32 = 3;

/// A module's functions on one device, kept for the life of the process.
struct Loaded {
    ctx: sys::CUcontext,
    functions: HashMap<String, sys::CUfunction>,
    /// The device's multiprocessor count.
    multiprocessors: u32,
    /// [`Kernel::resident_blocks`] by function and block size.
    resident: HashMap<(String, u32), u32>,
}

impl Loaded {
    fn function(&self, kernel: &str, function: &str) -> Result<sys::CUfunction> {
        self.functions
            .get(function)
            .copied()
            .ok_or_else(|| Error::invalid(format!("kernel source {kernel} defines no function {function}")))
    }
}

// SAFETY: driver handles are plain identifiers, usable from any thread.
unsafe impl Send for Loaded {}

/// A device's primary context, compute capability (`90` for 9.0) and multiprocessor count.
struct Device {
    ctx: sys::CUcontext,
    arch: u32,
    multiprocessors: u32,
}

impl Device {
    fn get(ordinal: usize) -> Result<Device> {
        engine::cuda::require()?;
        // SAFETY: checked first that the driver library is there (cudarc panics otherwise).
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::invalid("libcuda (the NVIDIA driver library) cannot be loaded"));
        }
        let ctx = |what: &str, e| Error::driver(format!("{what} of cuda:{ordinal}"), e);
        cu::init().map_err(|e| ctx("initialising the driver", e))?;
        let dev = cu::device::get(ordinal as i32).map_err(|e| ctx("getting the device", e))?;
        let attr = |a| unsafe { cu::device::get_attribute(dev, a) };
        use sys::CUdevice_attribute::*;
        let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(|e| ctx("compute capability", e))?;
        let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).map_err(|e| ctx("compute capability", e))?;
        let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| ctx("multiprocessor count", e))?;
        // SAFETY: `dev` is a valid device. The primary context is libtorch's own; retained once
        // per load and never released, as it lives as long as the process.
        let pctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| ctx("retaining the primary context", e))?;
        Ok(Device { ctx: pctx, arch: (major * 10 + minor) as u32, multiprocessors: sms.max(1) as u32 })
    }
}

/// Makes a context current for the guard's life and restores the caller's afterwards, so that
/// libtorch's idea of the current device on this thread is untouched.
struct ContextGuard;

impl ContextGuard {
    fn push(ctx: sys::CUcontext) -> Result<ContextGuard> {
        // SAFETY: a retained primary context.
        unsafe { sys::cuCtxPushCurrent_v2(ctx) }
            .result()
            .map_err(|e| Error::driver("making the context current", e))?;
        Ok(ContextGuard)
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops what `push` pushed on this thread.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}
