//! Writes every kernel's PTX for one architecture into a folder, one `<kernel>.ptx` each, for
//! tools that read PTX (`scripts/kernel-registers.sh` runs `ptxas -v` on them).
//!
//! `cargo run -p kernels --example ptx -- <folder> [arch, default 90]`
use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().context("usage: ptx <folder> [arch]")?);
    let arch: u32 = args.next().map_or(Ok(90), |a| a.parse().with_context(|| format!("arch {a:?}")))?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for kernel in kernels::ALL {
        let ptx = kernel.ptx(arch)?;
        let path = dir.join(format!("{}.ptx", kernel.name));
        std::fs::write(&path, ptx).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
