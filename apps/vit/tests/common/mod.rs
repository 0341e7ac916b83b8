//! What the `vit pretrain` test binaries share: arguments from a command line, the
//! one-process world, run comparisons and per-job scratch folders.
use clap::Parser;
use engine::dist::{InitOptions, World};
use suite_tests::TEST_TIMEOUT;
use vit::args::PretrainArgs;
use vit::train::Trained;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: PretrainArgs,
}

/// Pretrain arguments from a command line (after `vit pretrain`): quiet, small batches unless
/// `line` says otherwise.
pub fn args(line: &str) -> PretrainArgs {
    let defaults = [("--batch", "32"), ("--warmup", "5"), ("--lr", "4e-3"), ("--timeout", "60")];
    let mut words = vec!["vit", "--quiet"];
    for (flag, value) in defaults {
        if !line.split_whitespace().any(|w| w == flag) {
            words.extend([flag, value]);
        }
    }
    words.extend(line.split_whitespace());
    Cli::parse_from(words).args
}

/// What clap says about command line `line` (after `vit pretrain`), which it must refuse.
#[allow(dead_code)] // pretrain.rs's only
pub fn refused(line: &str) -> String {
    match Cli::try_parse_from(["vit"].into_iter().chain(line.split_whitespace())) {
        Ok(_) => panic!("{line} was accepted"),
        Err(e) => e.to_string(),
    }
}

pub fn single() -> World {
    World::single(&InitOptions { timeout: TEST_TIMEOUT }).unwrap()
}

/// Asserts that per-step losses of `a` are within `rtol` of `b`'s, and every weight within
/// `weight_rtol` (relative to its largest magnitude).
pub fn compare_with(a: &Trained, b: &Trained, what: &str, rtol: f64, weight_rtol: f64) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: step counts");
    for ((sa, la), (sb, lb)) in a.losses.iter().zip(&b.losses) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() <= rtol * lb.abs(), "{what}: step {sa} loss {la} vs {lb}");
    }
    assert_eq!(a.weights.len(), b.weights.len());
    for ((na, ta), (nb, tb)) in a.weights.iter().zip(&b.weights) {
        assert_eq!(na, nb);
        assert_eq!(ta.size(), tb.size(), "{what}: {na} is not a full tensor");
        let (ta, tb) = match na.ends_with("attn.qkv.bias") && weight_rtol > rtol {
            // The key bias adds one constant to each query's scores, which softmax removes:
            // its gradient is zero but for rounding, and Adam's small eps turns that noise into
            // full-size steps, different in any two summation orders. Queries and values only.
            true => {
                let d = ta.size()[0] / 3;
                let qv = |t: &tch::Tensor| tch::Tensor::cat(&[t.narrow(0, 0, d), t.narrow(0, 2 * d, d)], 0);
                (qv(ta), qv(tb))
            }
            false => (ta.shallow_clone(), tb.shallow_clone()),
        };
        let diff = (&ta - &tb).abs().max().double_value(&[]);
        let scale = tb.abs().max().double_value(&[]).max(1e-12);
        assert!(diff <= weight_rtol * scale, "{what}: {na} differs by {diff:.3e} (max |w| {scale:.3e})");
    }
}

/// [`compare_with`] at one tolerance for losses and weights.
pub fn compare(a: &Trained, b: &Trained, what: &str, rtol: f64) {
    compare_with(a, b, what, rtol, rtol)
}

/// A folder every rank of this job names alike (the job's rendezvous port is shared).
pub fn job_dir(name: &str) -> std::path::PathBuf {
    let port = std::env::var("MASTER_PORT").unwrap_or_default();
    std::env::temp_dir().join(format!("vit-job-{port}-{name}"))
}

/// Empties `dirs` (rank 0 removes them, every rank waits), for runs that save checkpoints.
#[allow(dead_code)] // the multi-rank binaries' only
pub fn fresh(world: &World, dirs: &[&std::path::Path]) -> suite_tests::TestResult {
    if world.rank() == 0 {
        for d in dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    world.group.barrier()?;
    suite_tests::TestResult::Ok(())
}

/// `reference`'s losses up to the checkpoint followed by `rest`'s: the whole curve of a run
/// resumed at step 3.
#[allow(dead_code)] // the multi-rank binaries' only
pub fn joined(reference: &Trained, rest: Trained) -> Trained {
    Trained { losses: [&reference.losses[..3], &rest.losses[..]].concat(), ..rest }
}
