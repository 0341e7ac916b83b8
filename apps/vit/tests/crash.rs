//! Crash and resume: a 2-rank `vit pretrain` that checkpoints every step is killed with
//! SIGKILL (the spawner and both ranks at once, as a scheduler's kill would) at moments spread
//! over steps and saves, ten times in a row, resumed after each; the run then ends with the
//! weights of an uninterrupted run, bit for bit.
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use suite_tests::{scratch, sorted_safetensors};

const KILLS: usize = 10;

/// `vit pretrain` on the digits, 2 ranks, a checkpoint every step, into `out`.
fn pretrain(out: &Path, resume: bool) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vit"));
    let out = out.to_str().unwrap();
    cmd.args(["pretrain", "--quiet", "--nproc", "2", "--steps", "64", "--batch", "32", "--warmup", "5"]);
    cmd.args(["--lr", "4e-3", "--save-every", "1", "--timeout", "60", "--out", out]);
    if resume {
        cmd.arg("--resume");
    }
    // Its own process group: the spawner's ranks inherit it, so one killpg stops the whole job.
    cmd.process_group(0).stdout(Stdio::null()).stderr(Stdio::piped());
    cmd
}

fn run_to_end(out: &Path, resume: bool) {
    let result = pretrain(out, resume).output().unwrap();
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
}

/// When attempt `i` is killed: after it has saved 1 to 3 checkpoints of its own (so every
/// attempt makes progress however slow the machine), plus 0 to 150 ms (a spread of moments
/// within steps and saves).
fn kill_point(i: usize) -> (usize, Duration) {
    (1 + i % 3, Duration::from_millis((i as u64 * 7919) % 150))
}

#[test]
fn killed_ten_times_and_resumed_ends_as_an_uninterrupted_run() {
    let dir = scratch("vit-crash", "run");
    let (whole, killed) = (dir.join("whole"), dir.join("killed"));
    run_to_end(&whole, false);
    let mut kills = 0;
    let mut attempts = 0;
    // The checkpoint each killed attempt resumed from (none: started fresh).
    let mut resumed_from = vec![];
    while kills < KILLS {
        attempts += 1;
        assert!(attempts < 4 * KILLS, "the job never ran long enough to be killed {KILLS} times");
        // Resume once a checkpoint exists (a kill before the first save starts over).
        let latest = std::fs::read_to_string(killed.join("latest")).ok();
        let mut child = pretrain(&killed, latest.is_some()).spawn().unwrap();
        let (saves, extra) = kill_point(attempts);
        let start = Instant::now();
        let (mut seen, mut new_saves, mut kill_at) = (latest.clone(), 0, None);
        while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(120) {
            let now = std::fs::read_to_string(killed.join("latest")).ok();
            if now != seen {
                (seen, new_saves) = (now, new_saves + 1);
                if new_saves == saves {
                    kill_at = Some(Instant::now() + extra);
                }
            }
            if kill_at.is_some_and(|at| Instant::now() >= at) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "an uninterrupted attempt failed: {status}");
            // It finished before the kill: start the run again from scratch to go on killing.
            std::fs::remove_dir_all(&killed).unwrap();
            continue;
        }
        // SAFETY: signalling the process group this test created.
        unsafe { libc::killpg(child.id() as i32, libc::SIGKILL) };
        child.wait().unwrap();
        kills += 1;
        resumed_from.push(latest);
    }
    eprintln!("killed {kills} times; the attempts resumed from {resumed_from:?}");
    let resumed: std::collections::BTreeSet<_> = resumed_from.iter().flatten().collect();
    // Every attempt after the first resumed from a later checkpoint than the one before.
    assert!(resumed.len() >= KILLS - 1, "attempts did not all resume from new checkpoints: {resumed_from:?}");
    run_to_end(&killed, killed.join("latest").exists());
    let read = |p: &Path| sorted_safetensors(&p.join("model.safetensors"));
    let (a, b) = (read(&whole), read(&killed));
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{na} differs after {kills} kills and resumes");
    }
    // The log reads as one run: one record per step, in order.
    let log = std::fs::read_to_string(killed.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> =
        log.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=64).collect::<Vec<u64>>());
}
