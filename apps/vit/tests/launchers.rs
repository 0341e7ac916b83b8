//! The launchers clusters use, started for real on this machine: `torchrun --nproc-per-node 2`
//! (from the project's Python environment), OpenMPI's `mpirun -np 2`, and Slurm's
//! `srun --ntasks 2` and `sbatch` on a one-node cluster the test starts (Debian's slurm-wlm and
//! munge, installed by `scripts/setup.sh`) each run `vit pretrain`, and the trained weights
//! equal the engine's own spawner's run bit for bit. Under mpirun no `MASTER_ADDR` is needed on one node; under
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
    check(cmd.output().unwrap_or_else(|e| panic!("starting {what}: {e}")), what);
}

/// Asserts that a job's output says it succeeded on 2 ranks.
fn check(out: std::process::Output, what: &str) {
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
    let (wa, wb) = (weights(a), weights(b));
    assert!(!wa.is_empty() && wa.len() == wb.len(), "{what}: {} weights, the spawner's run {}", wa.len(), wb.len());
    for ((na, ta), (nb, tb)) in wa.iter().zip(&wb) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{what}: {na} differs from the spawner's run");
    }
}

/// The losses of a run's `metrics.jsonl`, step by step.
fn losses(dir: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let record = |l: &str| serde_json::from_str::<serde_json::Value>(l).unwrap();
    text.lines().map(record).map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap())).collect()
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
    let start = |rank: usize, world: usize, port: u16, out: &Path, steps: &str| {
        Command::new(VIT)
            .args(["pretrain", "--quiet", "--steps", steps, "--batch", "8", "--timeout", "10", "--out"])
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

    // The duplicate starts once ranks 0 and 1 have joined (rank 0 announces the job after the
    // rendezvous), into a job that trains until it is stopped: started together, a duplicate
    // slow to load could find the two-step job already over and the store gone, and fail on
    // the connection instead.
    let port = free_port();
    let mut pair = [start(0, 2, port, &dir.join("a"), "1000000"), start(1, 2, port, &dir.join("a"), "1000000")];
    let stdout = pair[0].stdout.take().unwrap();
    let (joined, announced) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let line =
            std::io::BufReader::new(stdout).lines().map_while(Result::ok).find(|l| l.starts_with("vit pretrain:"));
        joined.send(line).ok();
    });
    let line = announced.recv_timeout(std::time::Duration::from_secs(90));
    assert!(matches!(line, Ok(Some(ref l)) if l.contains("2 rank(s)")), "ranks 0 and 1 did not start a job: {line:?}");
    let twice = finish(vec![start(1, 2, port, &dir.join("a"), "1000000")]);
    let running: Vec<bool> = pair.iter_mut().map(|c| c.try_wait().unwrap().is_none()).collect();
    for child in &mut pair {
        child.kill().ok();
    }
    let pair_stderr = finish(pair.into());
    assert!(!twice[0].0, "the duplicate fails");
    assert!(
        twice[0]
            .1
            .contains("RANK=1: another process of this job has the same rank (each needs its own, below WORLD_SIZE=2)"),
        "{}",
        twice[0].1
    );
    assert_eq!(running, [true, true], "the job of ranks 0 and 1 trains on: {pair_stderr:#?}");

    let port = free_port();
    let sizes = finish(vec![start(0, 2, port, &dir.join("b"), "2"), start(1, 3, port, &dir.join("b"), "2")]);
    assert!(sizes.iter().all(|(ok, _)| !ok), "{sizes:#?}");
    assert!(sizes[1].1.contains("WORLD_SIZE=3 here, but rank 0 has WORLD_SIZE=2"), "{}", sizes[1].1);
    assert!(sizes[0].1.contains("lost peer: rank 1"), "rank 0 names its missing peer: {}", sizes[0].1);
    // Rank 0 with the larger world: it used to wait in the store for a third rank while rank 1
    // waited for its world size, both until the timeout, neither naming WORLD_SIZE.
    let port = free_port();
    let sizes = finish(vec![start(0, 3, port, &dir.join("c"), "2"), start(1, 2, port, &dir.join("c"), "2")]);
    assert!(sizes[1].1.contains("WORLD_SIZE=2 here, but rank 0 has WORLD_SIZE=3"), "{}", sizes[1].1);
    assert!(!sizes[0].0, "{}", sizes[0].1);
    assert!(began.elapsed() < std::time::Duration::from_secs(120), "took {:?}", began.elapsed());
}

/// Slurm, for real: on a one-node cluster the test starts (slurmctld, slurmd and munged on this
/// machine, [`suite_tests::slurm`]), `srun --ntasks 2 vit pretrain` and an `sbatch` script like
/// docs/engine.md's each train the spawner's `--nproc 2` run, loss for loss and weight for
/// weight. The ranks find each other from Slurm's variables alone (rank, world, local rank,
/// the node list's first host as the rendezvous address); each gets the spawner's thread count
/// (`OMP_NUM_THREADS`, as a batch script sets it from `--cpus-per-task`). Skipped, saying why,
/// where the cluster cannot start (no Slurm, not root); under SUITE_REQUIRE_SLURM=1 that fails.
#[test]
fn srun_and_sbatch_jobs_equal_the_spawners() {
    use suite_tests::slurm::{output_within, slurm_cluster};
    let dir = scratch("vit-launchers", "slurm");
    let Some(cluster) = slurm_cluster(&dir.join("cluster"), "srun_and_sbatch_jobs_equal_the_spawners") else {
        return;
    };
    let spawned = dir.join("spawner");
    let mut cmd = Command::new(VIT);
    cmd.args(pretrain_args(&spawned)).args(["--nproc", "2"]);
    run(cmd, "the spawner");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).div_ceil(2).to_string();
    // The node is this machine's host name; where it does not resolve, the rendezvous address
    // is given, as a batch script on such a cluster would.
    let resolves = std::net::ToSocketAddrs::to_socket_addrs(&(cluster.node(), 0)).is_ok();
    let limit = std::time::Duration::from_secs(300);

    let srun = dir.join("srun");
    let mut cmd = cluster.command("srun");
    cmd.args(["--ntasks", "2", "--nodes", "1", "--cpus-per-task", "1", "--kill-on-bad-exit=1", VIT])
        .args(pretrain_args(&srun))
        .env("MASTER_PORT", free_port().to_string())
        .env("OMP_NUM_THREADS", &threads)
        .env_remove("MASTER_ADDR");
    if !resolves {
        cmd.env("MASTER_ADDR", "127.0.0.1");
    }
    let out = output_within(&mut cmd, limit, "srun --ntasks 2 vit pretrain");
    check(out, &format!("srun --ntasks 2 (the cluster's logs:\n{})", cluster.logs()));
    assert_eq!(losses(&srun), losses(&spawned), "srun: the losses differ from the spawner's run");
    assert_same(&srun, &spawned, "srun");

    // A batch script as docs/engine.md has it: the first host of the job's nodes hosts the
    // rendezvous, the threads follow --cpus-per-task, srun starts the ranks.
    let batch = dir.join("sbatch");
    let master = if resolves { r#"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"# } else { "127.0.0.1" };
    let args: Vec<String> = pretrain_args(&batch).iter().map(|a| format!("'{a}'")).collect();
    let script = [
        "#!/bin/bash".to_string(),
        "#SBATCH --job-name=vit-pretrain".into(),
        "#SBATCH --nodes=1".into(),
        "#SBATCH --ntasks-per-node=2".into(),
        "#SBATCH --cpus-per-task=1".into(),
        format!("#SBATCH --output={}/sbatch-%j.out", dir.display()),
        "set -euo pipefail".into(),
        format!("export MASTER_ADDR={master}"),
        format!("export MASTER_PORT={}", free_port()),
        format!("export OMP_NUM_THREADS={threads}"),
        format!("srun '{VIT}' {}", args.join(" ")),
    ];
    let file = dir.join("vit.sbatch");
    std::fs::write(&file, script.join("\n") + "\n").unwrap();
    let out = output_within(cluster.command("sbatch").arg("--wait").arg(&file), limit, "sbatch --wait vit.sbatch");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let job = said.trim().rsplit(' ').next().unwrap_or_default().to_string();
    let log = std::fs::read_to_string(dir.join(format!("sbatch-{job}.out"))).unwrap_or_default();
    assert!(
        out.status.success(),
        "sbatch: {said}{}\nthe job's output:\n{log}\n{}",
        String::from_utf8_lossy(&out.stderr),
        cluster.logs()
    );
    assert!(log.contains("2 rank(s)"), "the batch job did not run 2 ranks:\n{log}");
    assert_eq!(losses(&batch), losses(&spawned), "sbatch: the losses differ from the spawner's run");
    assert_same(&batch, &spawned, "sbatch");
}
