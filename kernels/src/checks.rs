//! What every fused path checks before launching (device, dtype, layout, shapes), with
//! messages that name the operation and the argument; and the autograd connection.
use tch::{Kind, Tensor};

use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::launch::Target;
use crate::{Error, Result};

/// The kernels' name suffix for a tensor's dtype.
pub(crate) fn dtype(op: &str, name: &str, t: &Tensor) -> Result<&'static str> {
    match t.kind() {
        Kind::Float => Ok("f32"),
        Kind::BFloat16 => Ok("bf16"),
        Kind::Half => Ok("f16"),
        k => Err(Error::invalid(format!("{op}: {name} is {k:?}; the fused kernel takes f32, bf16 or f16"))),
    }
}

/// Where a launch on `tensors` runs: the CUDA device they are all on, or the CPU emulator for
/// CPU tensors once it is enabled. Each tensor is checked to be there, of `kind` where given,
/// and contiguous (the kernels index raw memory).
pub(crate) fn target(op: &str, kind: Option<Kind>, tensors: &[(&str, &Tensor)]) -> Result<Target> {
    target_rows(op, kind, tensors, &[])
}

/// [`target`] where the tensors named in `strided` may be any view (their kernel is given where
/// their rows lie); the others are checked contiguous.
pub(crate) fn target_rows(
    op: &str,
    kind: Option<Kind>,
    tensors: &[(&str, &Tensor)],
    strided: &[&str],
) -> Result<Target> {
    let mut target = None;
    for (name, t) in tensors {
        let here = Target::of(t.device()).ok_or_else(|| {
            Error::invalid(format!(
                "{op}: {name} is on {:?}; the fused kernel runs on CUDA tensors (use the torch backend)",
                t.device()
            ))
        })?;
        ensure!(
            target.is_none_or(|first| first == here),
            "{op}: {name} is on {:?}, other arguments on {:?}",
            here.device(),
            target.map(Target::device)
        );
        target = Some(here);
        if let Some(k) = kind {
            ensure!(t.kind() == k, "{op}: {name} is {:?}, expected {k:?} like the other arguments", t.kind());
        }
        ensure!(
            strided.contains(name) || t.is_contiguous(),
            "{op}: {name} is not contiguous (strides {:?})",
            t.stride()
        );
    }
    target.ok_or_else(|| Error::invalid(format!("{op}: no tensors")))
}

/// `rows x cols`, each fitting the kernels' 32-bit indices where they use them.
pub(crate) fn rows_cols(op: &str, t: &Tensor) -> Result<(i64, i64)> {
    let cols = *t.size().last().ok_or_else(|| Error::invalid(format!("{op}: a scalar input")))?;
    let numel = t.numel() as i64;
    let rows = if cols == 0 { 0 } else { numel / cols };
    ensure!(cols <= i32::MAX as i64 && rows <= i32::MAX as i64, "{op}: {rows} x {cols} is too large for one launch");
    Ok((rows, cols))
}

/// What an element-wise kernel over `tensors` needs, the first being `x` [.., cols] whose dtype
/// the others share: where it runs (each checked by [`target`]), the kernel name suffix of the
/// dtype, `cols` and the element count of `x`.
pub(crate) fn elementwise(op: &str, tensors: &[(&str, &Tensor)]) -> Result<(Target, &'static str, i64, i64)> {
    let (name, x) = tensors[0];
    let target = target(op, Some(x.kind()), tensors)?;
    let suffix = dtype(op, name, x)?;
    let (_, cols) = rows_cols(op, x)?;
    Ok((target, suffix, cols, x.numel() as i64))
}

/// `a / b` rounded up, for positive `b`.
pub(crate) fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Rows of at most this many elements go one warp each (`WARP_COLS` in prelude.cuh).
pub(crate) const WARP_COLS: i64 = 1024;

/// The quads per lane each warp row kernel is compiled for (`FOR_EACH_WARP_QUADS` in
/// prelude.cuh): a warp holds rows of up to 128 times as many elements.
pub(crate) const WARP_QUADS: [i64; 6] = [1, 2, 3, 4, 6, 8];

/// The least of [`WARP_QUADS`] whose warp holds a row of `cols` (at most [`WARP_COLS`]).
pub(crate) fn warp_quads(cols: i64) -> i64 {
    WARP_QUADS.into_iter().find(|q| 128 * q >= cols).unwrap_or(WARP_COLS / 128)
}

/// The entry points of a kernel source: `$plain` functions once per dtype (`_f32`, `_bf16`,
/// `_f16`), and for each of `$rows` the block kernel per dtype and the warp kernels per count of
/// [`WARP_QUADS`] and dtype (`{row}_warp{q}_{dtype}`), as [`launch_rows`] names them.
macro_rules! row_kernel_functions {
    (plain: [$($plain:literal),*], rows: [$($row:literal),*]) => {
        &[
            $(concat!($plain, "_f32"), concat!($plain, "_bf16"), concat!($plain, "_f16"),)*
            $(
                concat!($row, "_f32"), concat!($row, "_bf16"), concat!($row, "_f16"),
                concat!($row, "_warp1_f32"), concat!($row, "_warp1_bf16"), concat!($row, "_warp1_f16"),
                concat!($row, "_warp2_f32"), concat!($row, "_warp2_bf16"), concat!($row, "_warp2_f16"),
                concat!($row, "_warp3_f32"), concat!($row, "_warp3_bf16"), concat!($row, "_warp3_f16"),
                concat!($row, "_warp4_f32"), concat!($row, "_warp4_bf16"), concat!($row, "_warp4_f16"),
                concat!($row, "_warp6_f32"), concat!($row, "_warp6_bf16"), concat!($row, "_warp6_f16"),
                concat!($row, "_warp8_f32"), concat!($row, "_warp8_bf16"), concat!($row, "_warp8_f16"),
            )*
        ]
    };
}
pub(crate) use row_kernel_functions;

/// Launches a row kernel over `rows` rows of `cols`: `{function}_warp{q}_{suffix}`, a warp per
/// row four to a block with `q` = [`warp_quads`] quads per lane, for rows of up to
/// [`WARP_COLS`]; else `{function}_{suffix}`, a block per row. All take the same arguments.
pub(crate) fn launch_rows(
    kernel: &Kernel,
    function: &str,
    suffix: &str,
    at: Target,
    (rows, cols): (i64, i64),
    args: &mut Args,
) -> Result<()> {
    if cols <= WARP_COLS {
        let grid = (ceil_div(rows, 4).max(1) as u32, 1, 1);
        kernel.launch(&format!("{function}_warp{}_{suffix}", warp_quads(cols)), at, grid, 128, args)
    } else {
        kernel.launch(&format!("{function}_{suffix}"), at, (rows as u32, 1, 1), row_threads(cols), args)
    }
}

/// Threads per block for a kernel that gives one block to each row of `cols` elements.
pub(crate) fn row_threads(cols: i64) -> u32 {
    (ceil_div(cols, 32) * 32).clamp(32, 256) as u32
}

/// Whether a kernel may move four elements per access (`Quad` in prelude.cuh): `cols` a
/// multiple of 4 and every tensor's memory aligned to four of its elements (a contiguous view
/// into the middle of a storage may not be). Undefined tensors (absent options) pass.
pub(crate) fn quads(cols: i64, tensors: &[&Tensor]) -> bool {
    cols % 4 == 0
        && tensors
            .iter()
            .filter(|t| t.defined())
            .all(|t| (t.data_ptr() as usize).is_multiple_of(4 * t.kind().elt_size_in_bytes()))
}

/// The widest access, in elements, that a kernel moving rows of `cols` may make over `tensors`
/// (which share one dtype): 16 bytes (4 f32, 8 bf16 or f16), else 8, else 1 element. The width
/// divides `cols`, so that no vector straddles two rows, and every tensor's memory is aligned to
/// it (a contiguous view starting inside its storage may not be). Undefined tensors pass.
pub(crate) fn vector_width(cols: i64, tensors: &[&Tensor]) -> i64 {
    let defined: Vec<&&Tensor> = tensors.iter().filter(|t| t.defined()).collect();
    let Some(first) = defined.first() else { return 1 };
    let size = first.kind().elt_size_in_bytes() as i64;
    [16, 8]
        .into_iter()
        .map(|bytes| (bytes, bytes / size))
        .find(|&(bytes, w)| {
            w > 1 && cols % w == 0 && defined.iter().all(|t| (t.data_ptr() as usize).is_multiple_of(bytes as usize))
        })
        .map_or(1, |(_, w)| w)
}

/// Blocks for a grid-stride loop over `n` elements with 256 threads each.
pub(crate) fn grid_blocks(n: i64) -> u32 {
    ceil_div(n, 256).clamp(1, 1 << 20) as u32
}

/// Connects outputs computed by kernels to the autograd graph through `backward`, when any
/// input requires grad (else returns them as they are).
pub(crate) fn with_grad(
    name: &'static str,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    saved: Vec<Tensor>,
    backward: impl FnMut(&[Tensor], &[Tensor]) -> engine::Result<Vec<Option<Tensor>>> + Send + 'static,
) -> Result<Vec<Tensor>> {
    if !inputs.iter().any(|t| t.requires_grad()) {
        return Ok(outputs);
    }
    let forward = engine::autograd::Forward { outputs, saved, ..Default::default() };
    Ok(engine::autograd::apply(name, inputs, move |_| Ok(forward), backward)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warp_row_takes_the_least_quads_that_hold_it() {
        let q: Vec<i64> = [1, 128, 129, 256, 257, 384, 385, 512, 513, 768, 769, 1024].map(warp_quads).to_vec();
        assert_eq!(q, [1, 1, 2, 2, 3, 3, 4, 4, 6, 6, 8, 8]);
    }
}
