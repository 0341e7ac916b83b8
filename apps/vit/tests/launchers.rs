//! The launchers clusters use, started for real on this machine: `torchrun --nproc-per-node 2`
//! (from the project's Python environment) and OpenMPI's `mpirun -np 2` (installed by
//! `scripts/setup.sh`) each run `vit pretrain`, and the trained weights equal the engine's own
//! spawner's run bit for bit. Under mpirun no `MASTER_ADDR` is needed on one node; under
//! torchrun its agent hosts the rendezvous store and rank 0 only connects to it, and a job
//! torchrun restarts after a rank failed (`--max-restarts`) trains as if nothing had happened.
use std::path::Path;
use std::process::Command;

use suite_tests::{free_port, scratch, sorted_safetensors};
use tch::Tensor;

const VIT: &str = env!("CARGO_BIN_EXE_vit");

fn pretrain_args(out: &Path) -> Vec<String> {
    let flags = "pretrain --quiet --steps 4 --batch 32 --warmup 2 --lr 4e-3 --zero 1 --timeout 60 --out";
    flags.split_whitespace().map(String::from).chain([out.display().to_string()]).collect()
}

fn run(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("starting {what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed:\n{text}");
    assert!(text.contains("2 rank(s)"), "{what} did not run 2 ranks:\n{text}");
    // torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): a rank 0 that tried to
    // as well would fail to bind its port, and libtorch would print an error before going on.
    assert!(!text.contains("failed to bind"), "{what}: a rank tried to host the launcher's store:\n{text}");
}

fn weights(dir: &Path) -> Vec<(String, Tensor)> {
    sorted_safetensors(&dir.join("model.safetensors"))
}

fn assert_same(a: &Path, b: &Path, what: &str) {
    for ((na, ta), (nb, tb)) in weights(a).iter().zip(&weights(b)) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{what}: {na} differs from the spawner's run");
    }
}

#[test]
fn torchrun_and_mpirun_jobs_equal_the_spawners() {
    let dir = scratch("vit-launchers", "run");
    let spawned = dir.join("spawner");
    let mut cmd = Command::new(VIT);
    cmd.args(pretrain_args(&spawned)).args(["--nproc", "2"]);
    run(cmd, "the spawner");

    let python = std::env::var("SUITE_PYTHON").expect("SUITE_PYTHON (set by scripts/setup.sh's cargo config)");
    let torchrun = dir.join("torchrun");
    // torchrun's agent keeps its logs in a folder under Python's temporary directory, which it
    // leaves behind: in the scratch folder, they go with it.
    let mut cmd = Command::new(python);
    cmd.env("TMPDIR", &dir)
        .args(["-m", "torch.distributed.run", "--no-python", "--nproc-per-node", "2"])
        .args(["--master-port", &free_port().to_string(), VIT])
        .args(pretrain_args(&torchrun));
    run(cmd, "torchrun");
    assert_same(&torchrun, &spawned, "torchrun");

    // torchrun restarting a failed job (--max-restarts): its agent keeps the store, and the
    // second start must not read the first one's keys. Rank 1 of the first start fails once
    // rank 0 has joined (and left its address in the store). With the keys shared, three of
    // four such runs failed: rank 1 read rank 0's old address, and either found nothing there
    // or both waited in Gloo's handshake for good.
    let restarted = dir.join("restarted");
    let flaky = dir.join("flaky.sh");
    let script = [
        "#!/bin/sh",
        "if [ \"$TORCHELASTIC_RESTART_COUNT $RANK\" = '0 1' ]; then sleep 3; exit 3; fi",
        &format!("exec {VIT} \"$@\""),
    ];
    std::fs::write(&flaky, script.join("\n") + "\n").unwrap();
    std::fs::set_permissions(&flaky, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut cmd = Command::new(std::env::var("SUITE_PYTHON").unwrap());
    cmd.env("TMPDIR", &dir)
        .args(["-m", "torch.distributed.run", "--no-python", "--nproc-per-node", "2", "--max-restarts", "1"])
        .args(["--master-port", &free_port().to_string()])
        .arg(&flaky)
        .args(pretrain_args(&restarted));
    run(cmd, "torchrun --max-restarts 1");
    assert_same(&restarted, &spawned, "torchrun after a restart");

    let mpirun = dir.join("mpirun");
    let mut cmd = Command::new("mpirun");
    // No MASTER_ADDR: every rank is on this node. A port of our own, not the default's.
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["-x", &format!("MASTER_PORT={}", free_port()), VIT])
        .args(pretrain_args(&mpirun))
        .env_remove("MASTER_ADDR");
    run(cmd, "mpirun (Debian's openmpi-bin, installed by scripts/setup.sh)");
    assert_same(&mpirun, &spawned, "mpirun");
}

/// Processes started by hand with launcher variables that do not make one job: two given the
/// same RANK, and ranks that disagree on WORLD_SIZE. Each is an error naming the variable,
/// within the timeout, where the job would otherwise hang (or a duplicate train in its twin's
/// place and the job report success).
#[test]
fn ranks_given_twice_or_disagreeing_on_the_world_size_are_named() {
    let dir = scratch("vit-launchers", "membership");
    let start = |rank: usize, world: usize, port: u16, out: &Path| {
        Command::new(VIT)
            .args(["pretrain", "--quiet", "--steps", "2", "--batch", "8", "--timeout", "10", "--out"])
            .arg(out)
            .envs([("RANK", rank.to_string()), ("WORLD_SIZE", world.to_string()), ("MASTER_PORT", port.to_string())])
            .envs([("LOCAL_RANK", rank.to_string()), ("LOCAL_WORLD_SIZE", world.to_string())])
            .envs([("MASTER_ADDR", "127.0.0.1"), ("RUST_BACKTRACE", "0")])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let finish = |children: Vec<std::process::Child>| -> Vec<(bool, String)> {
        children
            .into_iter()
            .map(|c| {
                let out = c.wait_with_output().unwrap();
                (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
            })
            .collect()
    };
    let began = std::time::Instant::now();
    let port = free_port();
    let twice = finish(vec![
        start(0, 2, port, &dir.join("a")),
        start(1, 2, port, &dir.join("a")),
        start(1, 2, port, &dir.join("a")),
    ]);
    let named: Vec<&(bool, String)> =
        twice.iter().filter(|(_, e)| e.contains("RANK=1: another process of this job has the same rank")).collect();
    assert_eq!(named.len(), 1, "{twice:#?}");
    assert!(!named[0].0, "the duplicate fails");
    assert_eq!(twice.iter().filter(|(ok, _)| *ok).count(), 2, "the job of ranks 0 and 1 trains: {twice:#?}");

    let port = free_port();
    let sizes = finish(vec![start(0, 2, port, &dir.join("b")), start(1, 3, port, &dir.join("b"))]);
    assert!(sizes.iter().all(|(ok, _)| !ok), "{sizes:#?}");
    assert!(sizes[1].1.contains("WORLD_SIZE=3 here, but rank 0 has WORLD_SIZE=2"), "{}", sizes[1].1);
    assert!(sizes[0].1.contains("lost peer: rank 1"), "rank 0 names its missing peer: {}", sizes[0].1);
    // Rank 0 with the larger world: it used to wait in the store for a third rank while rank 1
    // waited for its world size, both until the timeout, neither naming WORLD_SIZE.
    let port = free_port();
    let sizes = finish(vec![start(0, 3, port, &dir.join("c")), start(1, 2, port, &dir.join("c"))]);
    assert!(sizes[1].1.contains("WORLD_SIZE=2 here, but rank 0 has WORLD_SIZE=3"), "{}", sizes[1].1);
    assert!(!sizes[0].0, "{}", sizes[0].1);
    assert!(began.elapsed() < std::time::Duration::from_secs(120), "took {:?}", began.elapsed());
}
