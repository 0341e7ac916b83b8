//! Joining a job: reading the launcher's environment (torchrun, Slurm, OpenMPI, or this
//! engine's own `--nproc` spawner, which speaks torchrun's variables) and rendezvous.
use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use crate::dist::group::ProcessGroup;
use crate::dist::store::Store;
use crate::{Error, Result};

/// Environment variable holding the rendezvous and collective timeout, in seconds.
pub const TIMEOUT_ENV: &str = "ENGINE_DIST_TIMEOUT";
/// Timeout used when neither a flag nor [`TIMEOUT_ENV`] gives one.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// torchrun's default master port, used when a launcher names none.
pub const DEFAULT_PORT: u16 = 29500;
/// Set to `True` by a launcher that hosts the rendezvous store itself (torchrun's agent, and
/// this engine's spawner): every rank then connects as a client, rank 0 included.
pub const AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// How many times torchrun has restarted the job's workers (`--max-restarts`).
pub const RESTART_COUNT_ENV: &str = "TORCHELASTIC_RESTART_COUNT";

/// Where this process sits in the job, as read from a launcher's environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this node.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Host of the rendezvous store (rank 0's node).
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Whether the launcher hosts the store ([`AGENT_STORE_ENV`]); else rank 0 does.
    pub agent_store: bool,
    /// Which start of the job this is: 0, then 1, 2, ... after each restart by the launcher
    /// ([`RESTART_COUNT_ENV`]).
    pub attempt: usize,
    /// Which launcher these values came from.
    pub launcher: Launcher,
}

/// The launchers whose environment is understood.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun, or this engine's own spawner (RANK, WORLD_SIZE, ...).
    Torchrun,
    /// OpenMPI's mpirun (OMPI_COMM_WORLD_*).
    OpenMpi,
    /// Slurm's srun (SLURM_PROCID, SLURM_NTASKS, ...).
    Slurm,
}

impl LaunchEnv {
    /// Reads the current process environment.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// Reads a launcher's variables; `None` when no launcher's variables are present.
    /// torchrun's names win over OpenMPI's, which win over Slurm's (an `srun` that starts
    /// torchrun or mpirun leaves Slurm's variables in the children's environment).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Option<LaunchEnv>> {
        let get = |k: &str| vars.get(k).map(String::as_str);
        let master_port = match get("MASTER_PORT") {
            Some(p) => parse::<u16>("MASTER_PORT", p)?,
            None => DEFAULT_PORT,
        };
        // Either of torchrun's pair alone is a broken launch, not a job of one process.
        let (launcher, rank, world, local_rank, local_world) = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            (
                Launcher::Torchrun,
                required(vars, "RANK")?,
                required(vars, "WORLD_SIZE")?,
                optional(vars, "LOCAL_RANK")?,
                optional(vars, "LOCAL_WORLD_SIZE")?,
            )
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            (
                Launcher::OpenMpi,
                required(vars, "OMPI_COMM_WORLD_RANK")?,
                required(vars, "OMPI_COMM_WORLD_SIZE")?,
                optional(vars, "OMPI_COMM_WORLD_LOCAL_RANK")?,
                optional(vars, "OMPI_COMM_WORLD_LOCAL_SIZE")?,
            )
        } else if get("SLURM_PROCID").is_some() {
            (
                Launcher::Slurm,
                required(vars, "SLURM_PROCID")?,
                required(vars, "SLURM_NTASKS")?,
                optional(vars, "SLURM_LOCALID")?,
                slurm_tasks_here(vars)?,
            )
        } else {
            return Ok(None);
        };
        if world == 0 {
            return Err(Error::Launch(format!("{launcher:?} job of 0 ranks: the world size must be at least 1")));
        }
        let master_addr = match (get("MASTER_ADDR"), launcher) {
            (Some(a), _) => a.to_string(),
            (None, Launcher::Slurm) => {
                let list = get("SLURM_JOB_NODELIST")
                    .or(get("SLURM_NODELIST"))
                    .ok_or_else(|| Error::Launch("Slurm job without MASTER_ADDR or SLURM_JOB_NODELIST".into()))?;
                first_host(list)?
            }
            (None, _) if world == 1 => "127.0.0.1".to_string(),
            // Every rank on this node (mpirun -np N on one machine): rank 0 is local.
            (None, _) if local_world == Some(world) => "127.0.0.1".to_string(),
            (None, l) => {
                return Err(Error::Launch(format!(
                    "{l:?} job of {world} ranks over several nodes without MASTER_ADDR: set MASTER_ADDR (and \
                     MASTER_PORT, default {DEFAULT_PORT}) to rank 0's host in every rank's environment, e.g. \
                     mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT={DEFAULT_PORT}"
                )))
            }
        };
        if rank >= world {
            return Err(Error::Launch(format!("rank {rank} is not below the world size {world}")));
        }
        let local_world_size = local_world.unwrap_or(world);
        // The local values pick each rank's GPU: out of range, two ranks would share one.
        if local_world_size == 0 || local_world_size > world {
            return Err(Error::Launch(format!(
                "{launcher:?} job: {local_world_size} ranks on this node, outside 1..={world} (the world size)"
            )));
        }
        let local_rank = local_rank.unwrap_or(rank % local_world_size);
        if local_rank >= local_world_size {
            return Err(Error::Launch(format!(
                "{launcher:?} job: local rank {local_rank} is not below the {local_world_size} ranks on this node"
            )));
        }
        Ok(Some(LaunchEnv {
            rank,
            world_size: world,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            // torchrun's spelling, as its workers read it: Python's str(True).
            agent_store: launcher == Launcher::Torchrun && get(AGENT_STORE_ENV) == Some("True"),
            attempt: if launcher == Launcher::Torchrun { optional(vars, RESTART_COUNT_ENV)?.unwrap_or(0) } else { 0 },
            launcher,
        }))
    }

    /// Where this rank sits and where the job meets, in one line (`env` subcommands print it).
    pub fn describe(&self) -> String {
        let host = if self.agent_store { "the launcher" } else { "rank 0" };
        let restart = if self.attempt > 0 { format!(", restart {}", self.attempt) } else { String::new() };
        format!(
            "rank {} of {} (local {} of {}) via {:?}, rendezvous {}:{} hosted by {host}{restart}",
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.launcher,
            self.master_addr,
            self.master_port
        )
    }

    /// Whether the rendezvous host is this machine's loopback address (a single-node job).
    pub fn is_loopback(&self) -> bool {
        self.master_addr == "localhost" || self.master_addr.parse::<IpAddr>().is_ok_and(|a| a.is_loopback())
    }
}

/// Slurm's task count on this node: from `SLURM_STEP_TASKS_PER_NODE` (srun's step), else
/// `SLURM_TASKS_PER_NODE`, else `SLURM_NTASKS_PER_NODE`, each a compressed per-node list such
/// as `4(x2),3`, read at `SLURM_NODEID` (a uniform list needs no node id). `None` when none
/// of them is set.
fn slurm_tasks_here(vars: &HashMap<String, String>) -> Result<Option<usize>> {
    let names = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"];
    let Some((name, spec)) = names.iter().find_map(|n| vars.get(*n).map(|v| (*n, v.as_str()))) else {
        return Ok(None);
    };
    let bad = || Error::Launch(format!("{name}={spec:?} is not a Slurm task count list such as 4(x2),3"));
    let mut counts = Vec::new();
    for part in spec.split(',') {
        let (count, times) = match part.split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let (count, times): (usize, usize) =
            (count.trim().parse().map_err(|_| bad())?, times.parse().map_err(|_| bad())?);
        counts.extend(std::iter::repeat_n(count, times));
    }
    match optional(vars, "SLURM_NODEID")? {
        Some(node) => counts.get(node).copied().map(Some).ok_or_else(|| {
            Error::Launch(format!("SLURM_NODEID={node} is past the {} nodes of {name}={spec:?}", counts.len()))
        }),
        None if counts.windows(2).all(|w| w[0] == w[1]) => Ok(counts.first().copied()),
        None => Err(Error::Launch(format!("{name}={spec:?} differs between nodes and SLURM_NODEID is not set"))),
    }
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| Error::Launch(format!("{name}={value:?} is not a valid number")))
}

fn required(vars: &HashMap<String, String>, name: &str) -> Result<usize> {
    let v = vars.get(name).ok_or_else(|| Error::Launch(format!("{name} is not set")))?;
    parse(name, v)
}

fn optional(vars: &HashMap<String, String>, name: &str) -> Result<Option<usize>> {
    vars.get(name).map(|v| parse(name, v)).transpose()
}

/// The first host of a Slurm node list such as `gpu[003-005,9],cpu1` (here `gpu003`).
pub fn first_host(list: &str) -> Result<String> {
    let list = list.trim();
    let bad = || Error::Launch(format!("cannot read the Slurm node list {list:?}"));
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..list[end..].find(']').map(|i| end + i).ok_or_else(bad)?];
        let first = inner.split([',', '-']).next().filter(|s| !s.is_empty()).ok_or_else(bad)?;
        Ok(format!("{prefix}{first}"))
    } else if prefix.is_empty() {
        Err(bad())
    } else {
        Ok(prefix.to_string())
    }
}

/// How to join a job.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Timeout for the rendezvous and for every collective of the job's groups.
    pub timeout: Duration,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions { timeout: timeout_from_env().unwrap_or(DEFAULT_TIMEOUT) }
    }
}

/// The timeout given by [`TIMEOUT_ENV`], if it is set and valid (an invalid value is said,
/// and ignored).
pub fn timeout_from_env() -> Option<Duration> {
    let value = std::env::var(TIMEOUT_ENV).ok()?;
    match crate::parse::seconds(&value) {
        Ok(s) => Some(Duration::from_secs_f64(s)),
        Err(why) => {
            eprintln!("warning: {TIMEOUT_ENV}={value:?} is not a timeout in seconds ({why}); ignored");
            None
        }
    }
}

/// This process's place in the job and the group of all ranks.
#[derive(Debug)]
pub struct World {
    /// The launcher's values (a world of one when started without a launcher).
    pub env: LaunchEnv,
    /// The group of every rank in the job.
    pub group: ProcessGroup,
}

impl World {
    /// A job of one process (what [`init`] gives without a launcher); also the one-process
    /// reference inside a multi-process test.
    pub fn single(opts: &InitOptions) -> Result<World> {
        let env = LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            agent_store: false,
            attempt: 0,
            launcher: Launcher::Torchrun,
        };
        let group = ProcessGroup::new(Store::in_memory()?, 0, vec![0], "world", opts.timeout, true)?;
        Ok(World { env, group })
    }

    /// Global rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.env.world_size
    }
}

impl Drop for World {
    /// The job's world going away ends this rank's heartbeat (a world of one has none).
    fn drop(&mut self) {
        if self.size() > 1 {
            super::heartbeat::stop();
        }
    }
}

/// Joins the job described by the environment, or makes a world of one when no launcher's
/// variables are set. The launcher hosts the TCP store where it says so (torchrun's agent,
/// the engine's spawner), else rank 0 does; every rank waits at most `opts.timeout`.
pub fn init(opts: &InitOptions) -> Result<World> {
    let env = match LaunchEnv::from_env()? {
        Some(env) => env,
        None => return World::single(opts),
    };
    let host = env.rank == 0 && !env.agent_store;
    // Rank 0 does not wait in the store for the others to connect (a world size of 0 there):
    // it publishes its world size at once, so that a rank launched with another one is named
    // (`check_membership`) rather than every rank waiting out the timeout; the process
    // group's rendezvous waits for the peers, and names those that never come.
    let mut store = Store::tcp(&env.master_addr, env.master_port, host, 0, opts.timeout)?;
    if env.agent_store {
        // The launcher's store outlives a failed start (torchrun --max-restarts) with that
        // start's keys in it: each start works under its own prefix, or its ranks would read the
        // dead ranks' addresses and connect to nothing.
        store = store.prefixed(&format!("attempt_{}", env.attempt))?;
    }
    if env.world_size > 1 {
        check_membership(&store, &env)?;
        super::heartbeat::start(&store, env.rank)?;
    }
    let group =
        ProcessGroup::new(store, env.rank, (0..env.world_size).collect(), "world", opts.timeout, env.is_loopback())?;
    Ok(World { env, group })
}

impl Launcher {
    /// The variables that give a rank and the world size under this launcher.
    fn variables(&self) -> (&'static str, &'static str) {
        match self {
            Launcher::Torchrun => ("RANK", "WORLD_SIZE"),
            Launcher::OpenMpi => ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS"),
        }
    }
}

/// Each rank claims its rank in the store and compares its world size with rank 0's: two
/// processes given one rank, or ranks that disagree on the world size, are errors naming the
/// variable, where the collectives would otherwise hang until their timeout (or a duplicate
/// would train in its twin's place).
fn check_membership(store: &Store, env: &LaunchEnv) -> Result<()> {
    let (rank_var, size_var) = env.launcher.variables();
    if store.add(&format!("engine/joined/{}", env.rank), 1)? > 1 {
        return Err(Error::invalid(format!(
            "{rank_var}={}: another process of this job has the same rank (each needs its own, below {size_var}={})",
            env.rank, env.world_size
        )));
    }
    const WORLD_KEY: &str = "engine/world_size";
    if env.rank == 0 {
        return store.set(WORLD_KEY, env.world_size.to_string().as_bytes());
    }
    let theirs = store.get(WORLD_KEY)?;
    let theirs = String::from_utf8_lossy(&theirs);
    if theirs != env.world_size.to_string() {
        return Err(Error::invalid(format!(
            "{size_var}={} here, but rank 0 has {size_var}={theirs}: every rank needs the same world size",
            env.world_size
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn torchrun_variables() {
        let env = LaunchEnv::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (3, 8, 1, 2));
        assert_eq!((env.master_addr.as_str(), env.master_port), ("node0", 1234));
        assert_eq!(env.launcher, Launcher::Torchrun);
        assert!(!env.is_loopback());
        assert!(!env.agent_store, "rank 0 hosts the store unless the launcher says it does");
    }

    #[test]
    fn a_launcher_that_hosts_the_store_says_so() {
        let with = |flag: &str| {
            let env = LaunchEnv::from_vars(&vars(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                (AGENT_STORE_ENV, flag),
            ]));
            env.unwrap().unwrap()
        };
        assert!(with("True").agent_store);
        assert!(with("True").describe().ends_with("rendezvous 127.0.0.1:29500 hosted by the launcher"));
        assert!(!with("False").agent_store);
        let restarted = LaunchEnv::from_vars(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            (RESTART_COUNT_ENV, "2"),
        ]));
        let restarted = restarted.unwrap().unwrap();
        assert_eq!(restarted.attempt, 2);
        assert_eq!(
            restarted.describe(),
            "rank 0 of 2 (local 0 of 2) via Torchrun, rendezvous 127.0.0.1:29500 hosted by rank 0, restart 2"
        );
        // Slurm's and OpenMPI's ranks host their own store, whatever a parent torchrun left behind.
        let env = LaunchEnv::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            (AGENT_STORE_ENV, "True"),
        ]));
        assert!(!env.unwrap().unwrap().agent_store);
    }

    #[test]
    fn slurm_variables_take_master_from_node_list() {
        let env = LaunchEnv::from_vars(&vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_JOB_NODELIST", "gpu[007-008]"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (5, 8, 1, 4));
        assert_eq!((env.master_addr.as_str(), env.master_port), ("gpu007", DEFAULT_PORT));
        assert_eq!(env.launcher, Launcher::Slurm);
    }

    #[test]
    fn slurm_counts_the_tasks_of_this_node() {
        let slurm = |extra: &[(&str, &str)]| {
            let base = [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "7"), ("SLURM_LOCALID", "1"), ("MASTER_ADDR", "h")];
            LaunchEnv::from_vars(&vars(&[&base[..], extra].concat())).map(|e| e.unwrap().local_world_size)
        };
        // Without --ntasks-per-node: only the compressed list says how many run here.
        assert_eq!(slurm(&[("SLURM_TASKS_PER_NODE", "4(x1),3"), ("SLURM_NODEID", "1")]).unwrap(), 3);
        assert_eq!(slurm(&[("SLURM_TASKS_PER_NODE", "2(x2),3"), ("SLURM_NODEID", "1")]).unwrap(), 2);
        // srun's step list wins over the job's.
        let step = [("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"), ("SLURM_TASKS_PER_NODE", "7"), ("SLURM_NODEID", "2")];
        assert_eq!(slurm(&step).unwrap(), 2);
        let err = slurm(&[("SLURM_TASKS_PER_NODE", "4,3")]).unwrap_err().to_string();
        assert!(err.contains("differs between nodes and SLURM_NODEID is not set"), "{err}");
        let err = slurm(&[("SLURM_TASKS_PER_NODE", "4(x2"), ("SLURM_NODEID", "0")]).unwrap_err().to_string();
        assert!(err.contains("SLURM_TASKS_PER_NODE=\"4(x2\" is not a Slurm task count list"), "{err}");
        let err = slurm(&[("SLURM_TASKS_PER_NODE", "4"), ("SLURM_NODEID", "3")]).unwrap_err().to_string();
        assert!(err.contains("SLURM_NODEID=3 is past the 1 nodes"), "{err}");
    }

    #[test]
    fn local_ranks_out_of_range_are_errors() {
        let torchrun = |local: &str, local_world: &str| {
            let v = [("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", local), ("LOCAL_WORLD_SIZE", local_world)];
            LaunchEnv::from_vars(&vars(&[&v[..], &[("MASTER_ADDR", "127.0.0.1")]].concat())).map(|e| e.unwrap())
        };
        assert_eq!(torchrun("1", "2").unwrap().local_rank, 1);
        let err = torchrun("3", "2").unwrap_err().to_string();
        assert!(err.contains("local rank 3 is not below the 2 ranks on this node"), "{err}");
        for local_world in ["0", "3"] {
            let err = torchrun("0", local_world).unwrap_err().to_string();
            assert!(err.contains(&format!("{local_world} ranks on this node, outside 1..=2")), "{err}");
        }
        // One of torchrun's pair alone is a broken launch, not a world of one.
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "1")])).unwrap_err().to_string();
        assert!(err.contains("WORLD_SIZE is not set"), "{err}");
    }

    #[test]
    fn openmpi_variables_win_over_slurm() {
        let env = LaunchEnv::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.world_size, env.launcher), (1, 2, Launcher::OpenMpi));
        assert!(env.is_loopback());
    }

    #[test]
    fn mpirun_on_one_node_needs_no_master_addr_and_on_several_says_what_to_set() {
        let mpi = |local_size: &str| {
            LaunchEnv::from_vars(&vars(&[
                ("OMPI_COMM_WORLD_RANK", "1"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", local_size),
            ]))
        };
        let env = mpi("4").unwrap().unwrap();
        assert!(env.is_loopback() && env.master_port == DEFAULT_PORT);
        let err = mpi("2").unwrap_err().to_string();
        assert!(err.contains("several nodes") && err.contains("mpirun -x MASTER_ADDR="), "{err}");
    }

    #[test]
    fn no_launcher_means_none() {
        assert!(LaunchEnv::from_vars(&vars(&[("HOME", "/root")])).unwrap().is_none());
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "0"), ("WORLD_SIZE", "0")])).unwrap_err().to_string();
        assert!(err.contains("job of 0 ranks: the world size must be at least 1"), "{err}");
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("RANK=\"x\""), "{err}");
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])).unwrap_err();
        assert!(err.to_string().contains("rank 2 is not below the world size 2"), "{err}");
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("without MASTER_ADDR"), "{err}");
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node12").unwrap(), "node12");
        assert_eq!(first_host("a[01-04,07],b2").unwrap(), "a01");
        assert_eq!(first_host("x1,x2").unwrap(), "x1");
        assert!(first_host("a[").is_err());
        assert!(first_host("").is_err());
    }
}
