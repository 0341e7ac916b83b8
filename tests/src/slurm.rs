//! A one-node Slurm cluster for the tests that run jobs under `srun` and `sbatch`: `munged`,
//! `slurmctld` and `slurmd` on this machine (Debian's `munge` and `slurm-wlm`, which
//! scripts/setup.sh installs), configured in a scratch folder, on ports from [`free_port`],
//! started by the test and stopped (its jobs cancelled first) when the [`SlurmCluster`] is
//! dropped. Where it cannot start (no Slurm installed, not root: `slurmd` starts each task as
//! the job's user), [`slurm_cluster`] says why and the test skips, or fails under
//! `SUITE_REQUIRE_SLURM=1` (scripts/test.sh sets it where setup.sh has installed Slurm and runs
//! as root, as CI does).
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// With `SUITE_REQUIRE_SLURM=1`, a test that cannot start its Slurm cluster fails instead of
/// skipping.
pub const REQUIRE_SLURM_ENV: &str = "SUITE_REQUIRE_SLURM";

/// How long the daemons get to come up.
const START_LIMIT: Duration = Duration::from_secs(60);

/// A running one-node cluster (see the module docs).
pub struct SlurmCluster {
    conf: PathBuf,
    node: String,
    dir: PathBuf,
    /// The daemons, in the order they started (stopped in reverse).
    daemons: Vec<(&'static str, Child)>,
    /// Whether the cluster came up (and may have jobs to cancel when dropped).
    up: bool,
}

/// Where a program is: on `PATH`, else in the sbin folders a non-root `PATH` lacks.
fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let sbin = [PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")];
    std::env::split_paths(&path).chain(sbin).map(|d| d.join(program)).find(|p| p.is_file())
}

/// This machine's short host name (what slurmd calls its node and slurmctld checks itself
/// against).
fn short_hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = if ok { String::from_utf8_lossy(&buf[..end]).into_owned() } else { String::new() };
    name.split('.').next().unwrap_or_default().to_string()
}

/// The last `lines` lines of `path`, for error messages.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs `cmd` to its end within `limit`, its output collected; past the limit it is killed
/// and the call panics naming `what`, so a job that never finishes fails the test instead of
/// hanging it.
pub fn output_within(cmd: &mut Command, limit: Duration, what: &str) -> Output {
    match run_within(cmd, limit) {
        Ok(Ok(out)) => out,
        Ok(Err(out)) => panic!(
            "{what} did not finish within {limit:?}; killed. Output:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("starting {what}: {e}"),
    }
}

/// `cmd`'s output when it ends within `limit`, else (`Err` inside) what it wrote before it was
/// killed.
fn run_within(cmd: &mut Command, limit: Duration) -> std::io::Result<Result<Output, Output>> {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let read = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let out = read(child.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let err = read(child.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let waited = child.wait()?;
    let output =
        Output { status: waited, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() };
    Ok(match status {
        Some(_) => Ok(output),
        None => Err(output),
    })
}

impl SlurmCluster {
    /// Starts munged, slurmctld and slurmd with their files in `dir` (made here), and waits
    /// for the node to be idle; `Err` says why it could not.
    pub fn start(dir: &Path) -> Result<SlurmCluster, String> {
        let mut missing = Vec::new();
        let mut path = |p: &str| find(p).ok_or_else(|| missing.push(p.to_string())).unwrap_or_default();
        let (munged, slurmctld, slurmd) = (path("munged"), path("slurmctld"), path("slurmd"));
        for client in ["srun", "sbatch", "sinfo", "squeue", "scancel", "scontrol"] {
            path(client);
        }
        if !missing.is_empty() {
            return Err(format!(
                "Slurm is not installed (no {} here; scripts/setup.sh installs Debian's slurm-wlm and munge)",
                missing.join(", ")
            ));
        }
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(format!(
                "running as uid {uid}, not root: slurmd starts each task as the job's user, which only root can"
            ));
        }
        let node = short_hostname();
        if node.is_empty() {
            return Err("this machine has no host name to give the node".into());
        }
        std::fs::create_dir_all(dir.join("state")).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        std::fs::create_dir_all(dir.join("spool")).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // munged wants its socket's folder open to all, and a key only it can read.
        use std::os::unix::fs::PermissionsExt;
        let open = std::fs::Permissions::from_mode(0o755);
        std::fs::set_permissions(dir, open).map_err(|e| format!("{}: {e}", dir.display()))?;
        let key: Vec<u8> = (0..1024).map(|_| rand_byte()).collect();
        let key_file = dir.join("munge.key");
        std::fs::write(&key_file, key).map_err(|e| format!("{}: {e}", key_file.display()))?;
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).map_err(|e| e.to_string())?;
        let socket = dir.join("munge.socket");
        let conf = dir.join("slurm.conf");
        let d = dir.display();
        let ctld_port = free_port();
        let slurmd_port = std::iter::repeat_with(free_port).find(|&p| p != ctld_port).unwrap_or(ctld_port);
        let config = format!(
            "# A one-node test cluster (suite_tests::slurm), written for this run.\n\
             ClusterName=suite\nSlurmctldHost={node}(127.0.0.1)\nSlurmctldPort={ctld_port}\n\
             SlurmdPort={slurmd_port}\nAuthType=auth/munge\nCredType=cred/munge\n\
             AuthInfo=socket={}\nSlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool\nSlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n\
             SelectTypeParameters=CR_CPU\nSchedulerType=sched/builtin\nMpiDefault=none\nReturnToService=2\n\
             JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n\
             JobAcctGatherType=jobacct_gather/none\nSwitchType=switch/none\nSlurmdParameters=config_overrides\n\
             NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n\
             PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
            socket.display()
        );
        std::fs::write(&conf, config).map_err(|e| format!("{}: {e}", conf.display()))?;
        let mut cluster = SlurmCluster { conf, node, dir: dir.to_path_buf(), daemons: Vec::new(), up: false };
        let log = |name: &str| std::fs::File::create(dir.join(format!("{name}.out"))).map_err(|e| e.to_string());
        let munge = Command::new(munged)
            .arg("--foreground")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key_file.display()))
            .arg(format!("--pid-file={d}/munged.pid"))
            .arg(format!("--log-file={d}/munged.log"))
            .arg(format!("--seed-file={d}/munged.seed"))
            .stdout(log("munged")?)
            .stderr(log("munged")?)
            .spawn();
        cluster.daemons.push(("munged", munge.map_err(|e| format!("starting munged: {e}"))?));
        cluster.wait_for(|| socket.exists(), "munged's socket")?;
        let conf_arg = cluster.conf.clone();
        let ctld = Command::new(slurmctld)
            .arg("-D")
            .arg("-f")
            .arg(&conf_arg)
            .stdout(log("slurmctld")?)
            .stderr(log("slurmctld")?)
            .spawn();
        cluster.daemons.push(("slurmctld", ctld.map_err(|e| format!("starting slurmctld: {e}"))?));
        let node_arg = cluster.node.clone();
        let slurmd = Command::new(slurmd)
            .args(["-D", "-N", &node_arg, "-f"])
            .arg(&conf_arg)
            .stdout(log("slurmd")?)
            .stderr(log("slurmd")?)
            .spawn();
        cluster.daemons.push(("slurmd", slurmd.map_err(|e| format!("starting slurmd: {e}"))?));
        cluster.wait_for(|| cluster_idle(&conf_arg, &node_arg), "the node to be idle in sinfo")?;
        cluster.up = true;
        Ok(cluster)
    }

    /// Polls `ready` until it holds, a daemon exits (an error with its log) or the start limit
    /// passes.
    fn wait_for(&mut self, ready: impl Fn() -> bool, what: &str) -> Result<(), String> {
        let start = Instant::now();
        while !ready() {
            let exited = self.daemons.iter_mut().find_map(|(name, c)| c.try_wait().ok().flatten().map(|s| (*name, s)));
            if let Some((name, status)) = exited {
                return Err(format!("{name} exited ({status}) while waiting for {what}:\n{}", self.logs()));
            }
            if start.elapsed() > START_LIMIT {
                return Err(format!("no {what} within {START_LIMIT:?}:\n{}", self.logs()));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    /// The tails of the daemons' logs.
    pub fn logs(&self) -> String {
        ["munged.out", "munged.log", "slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log"]
            .iter()
            .map(|f| format!("--- {f}\n{}", tail(&self.dir.join(f), 15)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A Slurm client command (`srun`, `sbatch`, ...) pointed at this cluster (`SLURM_CONF`).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(find(program).unwrap_or_else(|| PathBuf::from(program)));
        cmd.env("SLURM_CONF", &self.conf);
        cmd
    }

    /// The node's name (this machine's short host name), as `SLURM_JOB_NODELIST` has it.
    pub fn node(&self) -> &str {
        &self.node
    }
}

/// Whether `node` is idle in `sinfo` under `conf`.
fn cluster_idle(conf: &Path, node: &str) -> bool {
    let out = Command::new(find("sinfo").unwrap_or_else(|| "sinfo".into()))
        .args(["-h", "-n", node, "-o", "%T"])
        .env("SLURM_CONF", conf)
        .stderr(Stdio::null())
        .output();
    out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
}

/// A random byte (the munge key's), from std's randomly keyed hasher: no dependency.
fn rand_byte() -> u8 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish() as u8
}

impl Drop for SlurmCluster {
    /// Cancels the cluster's jobs (their steps' processes belong to slurmstepd, which outlives
    /// slurmd), then stops the daemons: SIGTERM, and SIGKILL after 10 s.
    fn drop(&mut self) {
        let limit = Duration::from_secs(15);
        let jobs = |c: &SlurmCluster| -> Vec<String> {
            match run_within(c.command("squeue").args(["-h", "-o", "%i"]), limit) {
                Ok(Ok(o)) => String::from_utf8_lossy(&o.stdout).split_whitespace().map(String::from).collect(),
                _ => Vec::new(),
            }
        };
        let ids = if self.up { jobs(self) } else { Vec::new() };
        if !ids.is_empty() {
            let _ = run_within(self.command("scancel").args(&ids), limit);
            let start = Instant::now();
            while !jobs(self).is_empty() && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        for (_, child) in self.daemons.iter_mut().rev() {
            // SAFETY: kill(2) on the id of a child this process started and has not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            while matches!(child.try_wait(), Ok(None)) && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A cluster in `dir` for `test`; where it cannot start, `None` after saying why on stderr
/// (the test then skips), or a panic under [`REQUIRE_SLURM_ENV`]`=1`.
pub fn slurm_cluster(dir: &Path, test: &str) -> Option<SlurmCluster> {
    match SlurmCluster::start(dir) {
        Ok(cluster) => Some(cluster),
        Err(why) if std::env::var(REQUIRE_SLURM_ENV).is_ok_and(|v| v == "1") => {
            panic!("{test}: no Slurm cluster ({REQUIRE_SLURM_ENV}=1): {why}")
        }
        Err(why) => {
            eprintln!("{test}: skipped: no Slurm cluster: {why}");
            None
        }
    }
}
