//! Failures end jobs promptly with messages that name the rank and the cause; bad arguments
//! are errors, never aborts.
use std::time::{Duration, Instant};

use engine::dist::{self, ProcessGroup, ReduceOp, Store};
use suite_tests::{run_job, run_job_with_heartbeat, test_name, TestResult, WORKER_ENV};
use tch::{Device, Kind, Tensor};

const SHORT: &str = "4";

fn name(f: &str) -> String {
    test_name(module_path!(), f)
}

// The last rank fails; the others then fail on the lost peer, often within one poll of the
// supervisor, which must still name the rank that failed first, not the lowest-numbered one.
#[test]
fn a_rank_that_exits_early_ends_the_job_naming_it() {
    let start = Instant::now();
    let result = run_job(
        4,
        &name("a_rank_that_exits_early_ends_the_job_naming_it"),
        &[(dist::launch::TIMEOUT_ENV, SHORT)],
        |world| {
            if world.rank() == 3 {
                eprintln!("rank 3 giving up on purpose");
                std::process::exit(3);
            }
            let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
            world.group.all_reduce(&x, ReduceOp::Sum)?;
            world.group.all_reduce(&x, ReduceOp::Sum)?;
            Ok(())
        },
    );
    let err = result.expect_err("the job must fail").to_string();
    assert!(err.contains("rank 3 failed (exit code 3)"), "{err}");
    assert!(err.contains("rank 3 giving up on purpose"), "the report carries the rank's output: {err}");
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
}

/// The error of a 2-rank job under a 3 s heartbeat limit whose rank 1 runs `stall` after a
/// first collective, while rank 0 waits in the next one (left to the collective's 60 s
/// timeout: the heartbeat must name rank 1 long before).
fn job_with_a_stalled_rank(test: &str, stall: fn() -> TestResult) -> String {
    let start = Instant::now();
    let result = run_job_with_heartbeat(2, &name(test), &[], Some(Duration::from_secs(3)), |world| {
        let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
        world.group.all_reduce(&x, ReduceOp::Sum)?;
        if world.rank() == 1 {
            stall()?;
        }
        world.group.all_reduce(&x, ReduceOp::Sum)?;
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
    result.expect_err("the job must fail").to_string()
}

#[test]
fn a_rank_stuck_outside_collectives_is_ended_by_the_heartbeat_naming_it() {
    // Alive, heartbeat thread running, but no progress (a hung data loader, say).
    let err = job_with_a_stalled_rank("a_rank_stuck_outside_collectives_is_ended_by_the_heartbeat_naming_it", || {
        std::thread::sleep(Duration::from_secs(120));
        Ok(())
    });
    assert!(err.contains("rank 1 failed: rank 1 made no progress for"), "{err}");
    assert!(err.contains("outside collectives (--timeout 3.0 s)"), "{err}");
}

#[test]
fn a_stopped_rank_is_ended_by_the_heartbeat_naming_it() {
    // Stopped whole (SIGSTOP, a debugger, a swapped-out node): no pulses at all.
    let err = job_with_a_stalled_rank("a_stopped_rank_is_ended_by_the_heartbeat_naming_it", || {
        // raise(3), not kill(1): the stop takes effect before it returns, so the rank cannot
        // slip into its next collective first (seen once under load).
        // SAFETY: stopping this process, as a debugger or job control would.
        unsafe { libc::raise(libc::SIGSTOP) };
        Ok(())
    });
    assert!(err.contains("rank 1 failed: rank 1 stopped responding: no heartbeat for"), "{err}");
    assert!(err.contains("(--timeout 3.0 s)"), "{err}");
}

/// Rank 1 is SIGKILLed after a first collective; rank 0's next collective must fail naming it.
fn killed_peer_body(world: &dist::World) -> TestResult {
    let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
    world.group.all_reduce(&x, ReduceOp::Sum)?;
    if world.rank() == 1 {
        std::thread::sleep(Duration::from_millis(500));
        let me = std::process::id().to_string();
        std::process::Command::new("kill").args(["-KILL", &me]).status()?;
        std::thread::sleep(Duration::from_secs(60));
    }
    std::thread::sleep(Duration::from_secs(1));
    let err = world.group.all_reduce(&x, ReduceOp::Sum).expect_err("the peer is dead");
    anyhow::bail!("{err}")
}

/// The test binary re-run as `test`'s worker (the body runs in the children).
fn worker(test: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"]).env(WORKER_ENV, test).env("RUST_BACKTRACE", "0");
    cmd
}

/// Two ranks of `test` started by hand, no supervisor, meeting at `port` on this machine with a
/// collective timeout of `timeout` seconds and `env` besides; returns each rank's output.
fn two_ranks(test: &str, port: &str, timeout: &str, env: &[(&str, &str)]) -> Vec<std::process::Output> {
    let children: Vec<_> = (0..2)
        .map(|rank| {
            worker(test)
                .envs([("RANK", rank.to_string()), ("WORLD_SIZE", "2".into()), ("MASTER_PORT", port.into())])
                .envs([("MASTER_ADDR", "127.0.0.1"), (dist::launch::TIMEOUT_ENV, timeout)])
                .envs(env.iter().copied())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

#[test]
fn a_peer_killed_without_a_supervisor_is_named_by_the_survivor() {
    // As on a cluster where each node's launcher knows only its own ranks: nobody stops rank
    // 0 when rank 1 is killed; its next collective must fail, promptly, naming rank 1.
    let test = name("a_peer_killed_without_a_supervisor_is_named_by_the_survivor");
    if std::env::var(WORKER_ENV).as_deref() == Ok(test.as_str()) {
        let _ = run_job(2, &test, &[], killed_peer_body);
        return;
    }
    let start = Instant::now();
    let outputs = two_ranks(&test, &suite_tests::free_port().to_string(), "20", &[]);
    let survivor = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
    assert!(!outputs[0].status.success(), "rank 0 must fail");
    assert!(survivor.contains("all_reduce on rank 0 of group world (size 2) failed"), "{survivor}");
    assert!(survivor.contains("lost peer: rank 1"), "the survivor names the lost peer: {survivor}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?} (the timeout is 20 s)", start.elapsed());
}

#[test]
fn a_peer_killed_under_torchrun_is_named_by_the_survivor() {
    // Under torchrun. Its agent stops the other workers at its next check of their state once
    // one dies; checking every 10 s (`--monitor-interval`, as on a busy node or across nodes
    // whose agents learn late), the survivor reaches its next collective first.
    let test = name("a_peer_killed_under_torchrun_is_named_by_the_survivor");
    if std::env::var(WORKER_ENV).as_deref() == Ok(test.as_str()) {
        let _ = run_job(2, &test, &[], killed_peer_body);
        return;
    }
    let python = std::env::var("SUITE_PYTHON").expect("SUITE_PYTHON (set by scripts/setup.sh's cargo config)");
    // torchrun's agent leaves its log folder under Python's temporary directory: a scratch one.
    let tmp = suite_tests::scratch("suite-faults", "torchrun");
    let start = Instant::now();
    let out = std::process::Command::new(python)
        .env("TMPDIR", &tmp)
        .args(["-m", "torch.distributed.run", "--no-python", "--nproc-per-node", "2", "--monitor-interval", "10"])
        .args(["--master-port", &suite_tests::free_port().to_string()])
        .arg(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .envs([(WORKER_ENV, test.as_str()), ("RUST_BACKTRACE", "0"), (dist::launch::TIMEOUT_ENV, "20")])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "torchrun must report the failure:\n{text}");
    assert!(text.contains("all_reduce on rank 0 of group world (size 2) failed; lost peer: rank 1"), "{text}");
    assert!(start.elapsed() < Duration::from_secs(40), "took {:?}", start.elapsed());
}

#[test]
fn a_restarted_job_reads_no_key_of_its_failed_start() {
    // A launcher that restarts a failed job (torchrun --max-restarts) keeps hosting the same
    // store, with what the failed start left in it. Here that is a member count past the
    // world's size where the world's creation counts its connected members: read by the
    // second start, no member would see the count reach 2, and every one would wait in vain.
    let test = name("a_restarted_job_reads_no_key_of_its_failed_start");
    if std::env::var(WORKER_ENV).as_deref() == Ok(test.as_str()) {
        let _ = run_job(2, &test, &[], |world| {
            let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
            world.group.all_reduce(&x, ReduceOp::Sum)?;
            anyhow::ensure!(x.double_value(&[0]) == 2.0, "the sum of two ranks");
            Ok(())
        });
        return;
    }
    let agent = Store::agent(Duration::from_secs(20)).unwrap();
    let first_start = agent.prefixed("attempt_0").unwrap();
    first_start.add("eng-members-connected", 5).unwrap();
    agent.add("eng-members-connected", 5).unwrap(); // as a launcher that prefixes nothing
    let port = agent.port().unwrap().to_string();
    let env = [(dist::launch::AGENT_STORE_ENV, "True"), (dist::launch::RESTART_COUNT_ENV, "1")];
    for (rank, out) in two_ranks(&test, &port, SHORT, &env).into_iter().enumerate() {
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("test result: ok. 1 passed"), "rank {rank}:\n{text}");
    }
}

#[test]
fn a_collective_that_never_completes_times_out() {
    let start = Instant::now();
    let result = run_job(
        2,
        &name("a_collective_that_never_completes_times_out"),
        &[(dist::launch::TIMEOUT_ENV, SHORT)],
        |world| -> TestResult {
            if world.rank() == 1 {
                // Alive but never joins the collective.
                std::thread::sleep(Duration::from_secs(120));
                return Ok(());
            }
            let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
            let err = world.group.all_reduce(&x, ReduceOp::Sum).expect_err("no peer, no result");
            anyhow::bail!("all_reduce gave up: {err}")
        },
    );
    let err = result.expect_err("the job must fail").to_string();
    assert!(err.contains("rank 0 failed"), "{err}");
    assert!(err.contains("all_reduce on rank 0 of group world (size 2) failed"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(40), "took {:?}", start.elapsed());
}

#[test]
fn a_job_whose_ranks_run_no_test_fails() {
    // The children run the binary filtered to this name, which matches no test: they exit
    // cleanly having run nothing, and the harness must not count that as a pass.
    let result = run_job(2, &name("no_test_is_called_this"), &[], |_| Ok(()));
    let err = result.expect_err("a job that ran no test must fail").to_string();
    assert!(err.contains("ranks [0, 1] exited cleanly without running test"), "{err}");
}

#[test]
fn rendezvous_without_peers_times_out() {
    let start = Instant::now();
    let port = suite_tests::free_port();
    let err = Store::tcp("127.0.0.1", port, true, 2, Duration::from_secs(1)).unwrap_err().to_string();
    assert!(err.contains("rendezvous: hosting TCP store 127.0.0.1"), "{err}");
    // The cause, not only the context: a port someone else holds fails with the same prefix.
    assert!(err.contains("waiting for clients. 1/2 clients joined"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
}

#[test]
fn bad_arguments_are_errors() {
    let store = Store::in_memory().unwrap();
    let g = ProcessGroup::new(store, 0, vec![0], "solo", Duration::from_secs(1), true).unwrap();
    let x = Tensor::ones([3, 2], (Kind::Float, Device::Cpu));
    let int = Tensor::ones([2], (Kind::Int64, Device::Cpu));
    let cases: Vec<(engine::Error, &str)> = vec![
        (g.broadcast(&x, 1).unwrap_err(), "broadcast root 1 is not in group solo of size 1"),
        (g.send(&x, 0, 0).unwrap_err(), "cannot send from rank 0 to rank 0"),
        (g.all_to_all_uneven(&x, &[2], &[3]).unwrap_err(), "input splits sum to 2 but dim 0 has 3"),
        (g.all_to_all_uneven(&x, &[1, 2], &[3]).unwrap_err(), "2 input and 1 output splits"),
        (g.all_gather(&Tensor::from(1.0f32)).unwrap_err(), "needs a tensor with at least one dimension"),
        (g.all_reduce(&int, ReduceOp::Avg).unwrap_err(), "average of a Int64 tensor"),
        (g.subgroup(&[0, 0], "dup").unwrap_err(), "rank 0 is listed twice"),
        (g.all_gather_into_async(&x, &x.narrow(0, 0, 2)).unwrap_err(), "output has shape [3, 2], expected [2, 2]"),
        (g.all_to_all_into_async(&int, &x, &[3], &[3]).unwrap_err(), "output has shape [2], expected [3, 2]"),
        (g.subgroup(&[1], "out").unwrap_err(), "rank 1 is not in group solo"),
        (
            ProcessGroup::new(Store::in_memory().unwrap(), 2, vec![0, 1], "g", Duration::from_secs(1), true)
                .unwrap_err(),
            "rank 2 is not in group g of size 2",
        ),
        (dist::ParallelDims { pp: 1, dp: 3, sp: 1, tp: 1 }.build(&g).unwrap_err(), "= 3 ranks, but the job has 1"),
    ];
    for (err, want) in cases {
        assert!(err.to_string().contains(want), "{err} should mention {want:?}");
    }
    // An exception raised inside c10d itself: a key nobody sets.
    let store = Store::in_memory().unwrap();
    store.set_timeout(Duration::from_millis(100)).unwrap();
    let err = store.get("missing").unwrap_err().to_string();
    assert!(err.contains("reading \"missing\" from in-memory store"), "{err}");
}

#[test]
fn cuda_calls_without_a_gpu_say_so() {
    if engine::cuda::is_available() {
        return;
    }
    for err in [
        engine::cuda::memory_stats(0).unwrap_err(),
        engine::cuda::Stream::from_pool(0, false).err().unwrap(),
        engine::cuda::set_memory_fraction(0.5, 0).unwrap_err(),
        engine::cuda::Event::new(true).err().unwrap(),
    ] {
        assert!(err.to_string().starts_with("CUDA not available"), "{err}");
    }
}
