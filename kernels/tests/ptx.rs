//! Every kernel source compiles to PTX through NVRTC for sm_80 (A100) and sm_90 (H100) with
//! each of its functions, and the compiled PTX is cached on disk. Runs on any machine: NVRTC is
//! a library (scripts/setup.sh installs it with torch), so a missing one fails here.
use kernels::{nvrtc, ALL, CACHE_ENV};

#[test]
fn every_kernel_compiles_to_ptx_for_sm80_and_sm90_and_is_cached() {
    let scratch = suite_tests::scratch("kernels", "ptx");
    let cache = scratch.join("cache");
    // The only test in this binary: no other thread reads the environment meanwhile.
    unsafe { std::env::set_var(CACHE_ENV, &cache) };
    let nvrtc = nvrtc().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        nvrtc.archs.contains(&80) && nvrtc.archs.contains(&90),
        "NVRTC {} targets {:?}",
        nvrtc.version_string(),
        nvrtc.archs
    );
    for kernel in ALL {
        for arch in [80, 90] {
            let ptx = kernel.ptx(arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(ptx.contains(&format!(".target sm_{arch}")), "{} for {arch}: no .target line", kernel.name);
            for f in kernel.functions {
                assert!(ptx.contains(&format!(".entry {f}(")), "{} for sm_{arch} lacks {f}", kernel.name);
            }
        }
    }
    // One file per kernel and architecture, and a second call reads it instead of compiling.
    let files: Vec<_> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), ALL.len() * 2, "{files:?}");
    let file = files
        .iter()
        .find(|p| p.to_string_lossy().contains("layer_norm-") && p.to_string_lossy().ends_with("compute_90.ptx"))
        .unwrap();
    std::fs::write(file, "// cached\n").unwrap();
    let layer_norm = ALL.iter().find(|k| k.name == "layer_norm").unwrap();
    assert_eq!(layer_norm.ptx(90).unwrap(), "// cached\n");
}
