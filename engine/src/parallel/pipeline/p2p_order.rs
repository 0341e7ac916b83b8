//! Checks a schedule's exchanges under NCCL's point-to-point rules, which are stricter than
//! Gloo's (the rules the simulator and the CPU tests follow):
//! - tags are ignored: the k-th send from rank a to rank b fills the k-th receive b posts from
//!   a, whatever message each was meant to be;
//! - each pair of ranks has one stream per side, and a transfer larger than NCCL's staging
//!   buffer completes only when both sides' operations run at once: a send at the head of one
//!   side's stream waits for the matching receive to reach the head of the other's;
//! - an operation's stream first waits for the compute queued before it (the tensor it sends or
//!   overwrites), and a compute waits for the receive it consumes.
//!
//! The host queues all of that and runs ahead, except where it waits ([`HostStep`]):
//! - in the first step, where NCCL creates a pair's communicator (the pair's first exchange) and
//!   connects each direction (its first exchange that way), which holds both hosts until each
//!   reaches that point; where it copies a chunk's shape header to or from the device (a
//!   blocking copy, which waits for the compute queued before); and where it reads a received
//!   header before going on;
//! - in a measured step ([`super::Pipeline::measure`]), after every compute, which it waits for.
//!
//! [`check_p2p_order`] plays every rank's list on that model, for a first and a later step,
//! measured or not, and reports a message that would arrive in the wrong buffer, or a cycle of
//! waits (a hang), naming what each rank waits for.
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::schedule::{Action, Message, Schedule};
use crate::{Error, Result};

/// What crosses a pair's stream: a message, or the shape header of the boundary after virtual
/// stage `boundary` (in the first step, ahead of the chunk's first activation).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Crossing {
    Data(Message),
    Header { boundary: usize },
}

fn describe(c: Crossing) -> String {
    match c {
        Crossing::Data(Message { micro, boundary, grad: false }) => {
            format!("activation of micro-batch {micro} after stage {boundary}")
        }
        Crossing::Data(Message { micro, boundary, grad: true }) => {
            format!("gradient of micro-batch {micro} after stage {boundary}")
        }
        Crossing::Header { boundary } => format!("shape header after stage {boundary}"),
    }
}

/// One operation on a pair's stream.
#[derive(Clone, Copy, Debug)]
struct Op {
    /// Its index among the rank's operations.
    id: usize,
    send: bool,
    peer: usize,
    crossing: Crossing,
    /// How many of the rank's computes the host had queued when it issued the operation.
    after_computes: usize,
}

impl Op {
    fn describe(&self) -> String {
        let (verb, direction) = if self.send { ("send", "to") } else { ("receive", "from") };
        format!("{verb} {direction} rank {} ({})", self.peer, describe(self.crossing))
    }
}

/// What the host does next, in order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum HostStep {
    /// Queues a compute (by its index among the rank's computes).
    Compute(usize),
    /// Queues an operation (by its index).
    Issue(usize),
    /// Waits until every compute queued so far has run.
    Sync,
    /// Waits until `peer` reaches its own `Pair` step with this rank.
    Pair(usize),
    /// Waits until `peer` reaches its `Direction` step the other way.
    Direction { peer: usize, send: bool },
    /// Waits until the operation (a header's receive) completed.
    Read(usize),
}

impl HostStep {
    /// The step a peer must reach for this one to pass (for the two that need one).
    fn partner(self, me: usize) -> Option<(usize, HostStep)> {
        match self {
            HostStep::Pair(peer) => Some((peer, HostStep::Pair(me))),
            HostStep::Direction { peer, send } => Some((peer, HostStep::Direction { peer: me, send: !send })),
            _ => None,
        }
    }
}

/// One rank on the model: its host's steps, its streams, and how far each got.
struct Rank {
    host: Vec<HostStep>,
    /// The next host step to take.
    at: usize,
    ops: Vec<Op>,
    /// Per peer, the operations on that pair's stream not yet complete (ids, in order).
    streams: BTreeMap<usize, VecDeque<usize>>,
    /// For each compute: its action's list position, and the receive it consumes (op id).
    computes: Vec<(usize, Option<usize>)>,
    queued: usize,
    computed: usize,
    issued: usize,
    completed: HashSet<usize>,
}

impl Rank {
    fn new(schedule: &Schedule, r: usize, first_step: bool, measured: bool) -> Result<Rank> {
        let p = schedule.pp;
        let mut rank = Rank {
            host: Vec::new(),
            at: 0,
            ops: Vec::new(),
            streams: BTreeMap::new(),
            computes: Vec::new(),
            queued: 0,
            computed: 0,
            issued: 0,
            completed: HashSet::new(),
        };
        // The receive each message arrives by, and the directions and pairs met so far.
        let mut receive_of: HashMap<Message, usize> = HashMap::new();
        let (mut pairs, mut directions) = (HashSet::new(), HashSet::new());
        let (mut headers_sent, mut headers_received) = (HashSet::new(), HashSet::new());
        for (at, &a) in schedule.actions[r].iter().enumerate() {
            let message = schedule.message(r, a);
            let send = match a {
                Action::SendActivation(_) | Action::SendGrad(_) => true,
                Action::RecvActivation(_) | Action::RecvGrad(_) => false,
                Action::Forward(_) | Action::Backward(_) | Action::Weight(_) => {
                    let input = match message {
                        Some(m) => Some(*receive_of.get(&m).ok_or_else(|| {
                            Error::invalid(format!("pipeline schedule: rank {r} runs {a} before its receive"))
                        })?),
                        None => None,
                    };
                    rank.host.push(HostStep::Compute(rank.computes.len()));
                    rank.computes.push((at, input));
                    if measured {
                        rank.host.push(HostStep::Sync);
                    }
                    continue;
                }
            };
            let message = message.expect("an exchange is a message");
            // Activations go to the stage after the boundary, gradients to the one before.
            let peer = if send != message.grad { (message.boundary + 1) % p } else { message.boundary % p };
            let chunk = a.step().chunk;
            let header = first_step
                && match a {
                    Action::SendActivation(_) => headers_sent.insert(chunk),
                    Action::RecvActivation(_) => headers_received.insert(chunk),
                    _ => false,
                };
            // The runtime copies a header between host and device with a blocking copy, then
            // sends or receives it on the pair's stream ahead of the data.
            if header {
                rank.host.push(HostStep::Sync);
            }
            if first_step && pairs.insert(peer) {
                rank.host.push(HostStep::Pair(peer));
            }
            if first_step && directions.insert((peer, send)) {
                rank.host.push(HostStep::Direction { peer, send });
            }
            let push = |rank: &mut Rank, crossing: Crossing| {
                let id = rank.ops.len();
                rank.ops.push(Op { id, send, peer, crossing, after_computes: rank.computes.len() });
                rank.streams.entry(peer).or_default().push_back(id);
                rank.host.push(HostStep::Issue(id));
                id
            };
            if header {
                let id = push(&mut rank, Crossing::Header { boundary: message.boundary });
                // Reading it is a blocking copy to the host too.
                if !send {
                    rank.host.extend([HostStep::Read(id), HostStep::Sync]);
                }
            }
            let id = push(&mut rank, Crossing::Data(message));
            if !send {
                receive_of.insert(message, id);
            }
        }
        Ok(rank)
    }

    /// Takes the host steps that need nothing from other ranks; whether any was taken.
    fn advance_host(&mut self) -> bool {
        let start = self.at;
        while let Some(&step) = self.host.get(self.at) {
            match step {
                HostStep::Compute(_) => self.queued += 1,
                HostStep::Issue(_) => self.issued += 1,
                HostStep::Sync if self.computed == self.queued => {}
                HostStep::Read(id) if self.completed.contains(&id) => {}
                _ => break,
            }
            self.at += 1;
        }
        self.at > start
    }

    /// The host step it waits at, if any.
    fn waits_at(&self) -> Option<HostStep> {
        self.host.get(self.at).copied()
    }

    /// Runs the queued computes whose receives are in; whether any ran.
    fn run_computes(&mut self) -> bool {
        let start = self.computed;
        while self.computed < self.queued {
            match self.computes[self.computed].1 {
                Some(input) if !self.completed.contains(&input) => break,
                _ => self.computed += 1,
            }
        }
        self.computed > start
    }

    /// The head of the stream to `peer`, if it was issued and the computes queued before it ran.
    fn ready_head(&self, peer: usize) -> Option<Op> {
        let op = self.ops[*self.streams.get(&peer)?.front()?];
        (op.id < self.issued && self.computed >= op.after_computes).then_some(op)
    }

    fn complete_head(&mut self, peer: usize) {
        let id = self.streams.get_mut(&peer).and_then(VecDeque::pop_front).expect("a head to complete");
        self.completed.insert(id);
    }

    fn done(&self) -> bool {
        self.at == self.host.len() && self.computed == self.queued && self.streams.values().all(VecDeque::is_empty)
    }

    /// Where a stuck rank stands: its next compute, the heads of its streams, and what its host
    /// waits for.
    fn stuck(&self, r: usize, schedule: &Schedule) -> Option<String> {
        if self.done() {
            return None;
        }
        let next = self
            .computes
            .get(self.computed)
            .map_or("its end".to_string(), |&(at, _)| schedule.actions[r][at].to_string());
        let heads: Vec<String> =
            self.streams.values().filter_map(VecDeque::front).map(|&id| self.ops[id].describe()).collect();
        let heads = if heads.is_empty() { "nothing queued".to_string() } else { heads.join(", ") };
        let host = match self.waits_at() {
            Some(HostStep::Sync) => ", its host waiting for its computes".to_string(),
            Some(HostStep::Pair(peer)) => format!(", its host creating the communicator with rank {peer}"),
            Some(HostStep::Direction { peer, send: true }) => format!(", its host connecting to rank {peer}"),
            Some(HostStep::Direction { peer, send: false }) => format!(", its host connecting from rank {peer}"),
            Some(HostStep::Read(id)) => format!(", its host reading the {}", describe(self.ops[id].crossing)),
            _ => String::new(),
        };
        Some(format!("rank {r} at {next} with {heads}{host}"))
    }
}

/// Checks `schedule` on the model above, for the first step (which creates the communicators
/// and sends the shape headers) and for a later one, each measured and not. Errors name the
/// ranks, their next computes, their streams' heads and what their hosts wait for.
pub fn check_p2p_order(schedule: &Schedule) -> Result<()> {
    schedule.check_stages()?;
    for first_step in [true, false] {
        for measured in [false, true] {
            play(schedule, first_step, measured)?;
        }
    }
    Ok(())
}

/// One step of `schedule` (checked by [`Schedule::check_stages`]) on the model.
fn play(schedule: &Schedule, first_step: bool, measured: bool) -> Result<()> {
    let p = schedule.pp;
    let mut ranks = (0..p).map(|r| Rank::new(schedule, r, first_step, measured)).collect::<Result<Vec<Rank>>>()?;
    check_fifo_matching(schedule, &ranks)?;
    loop {
        let mut progressed = false;
        for rank in &mut ranks {
            progressed |= rank.advance_host();
            progressed |= rank.run_computes();
        }
        // Two hosts waiting for each other (a pair's communicator, a direction's connection)
        // both go on.
        for a in 0..p {
            if let Some((b, want)) = ranks[a].waits_at().and_then(|step| step.partner(a)) {
                if b > a && ranks[b].waits_at() == Some(want) {
                    ranks[a].at += 1;
                    ranks[b].at += 1;
                    progressed = true;
                }
            }
        }
        // A transfer runs when both sides' heads are ready and one sends what the other
        // receives (the matching below made sure it is the same message).
        for a in 0..p {
            for b in a + 1..p {
                while let (Some(x), Some(y)) = (ranks[a].ready_head(b), ranks[b].ready_head(a)) {
                    if x.send == y.send {
                        break;
                    }
                    ranks[a].complete_head(b);
                    ranks[b].complete_head(a);
                    progressed = true;
                }
            }
        }
        if ranks.iter().all(Rank::done) {
            return Ok(());
        }
        if !progressed {
            let stuck: Vec<String> = ranks.iter().enumerate().filter_map(|(r, rank)| rank.stuck(r, schedule)).collect();
            let step = if first_step { "first step" } else { "later steps" };
            let measured = if measured { ", measured" } else { "" };
            return Err(Error::invalid(format!(
                "pipeline schedule {} hangs on NCCL ({step}{measured}): {}",
                schedule.kind.name(),
                stuck.join("; ")
            )));
        }
    }
}

/// NCCL pairs the k-th send from a to b with the k-th receive b posts from a; both must be the
/// same message.
fn check_fifo_matching(schedule: &Schedule, ranks: &[Rank]) -> Result<()> {
    let messages = |rank: &Rank, peer: usize, send: bool| -> Vec<Crossing> {
        rank.ops.iter().filter(|op| op.peer == peer && op.send == send).map(|op| op.crossing).collect()
    };
    for (a, rank) in ranks.iter().enumerate() {
        for &b in rank.streams.keys() {
            let expected = messages(&ranks[b], a, false);
            for (k, (s, e)) in messages(rank, b, true).into_iter().zip(expected).enumerate() {
                if s != e {
                    return Err(Error::invalid(format!(
                        "pipeline schedule {}: on NCCL, the message {k} rank {a} sends to rank {b} is {} but rank {b} \
                         receives it as {}",
                        schedule.kind.name(),
                        describe(s),
                        describe(e)
                    )));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{ScheduleKind, Step};
    use super::*;

    #[test]
    fn every_schedule_is_safe_on_nccl() {
        for p in [2usize, 3, 4, 8] {
            for m in 1..=13 {
                let mut cases =
                    vec![(ScheduleKind::GPipe, 1), (ScheduleKind::OneFOneB, 1), (ScheduleKind::ZeroBubbleH1, 1)];
                if m < p || m.is_multiple_of(p) {
                    cases.extend([(ScheduleKind::Interleaved, 2), (ScheduleKind::Interleaved, 3)]);
                }
                for (kind, v) in cases {
                    let s = Schedule::new(kind, p, m, v).unwrap();
                    check_p2p_order(&s).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} v={v}: {e}"));
                }
            }
        }
    }

    fn s(micro: usize) -> Step {
        Step { micro, chunk: 0 }
    }

    /// `schedule` with `action` moved on `rank` to just before `before`. The simulator (Gloo's
    /// rules) still runs it.
    fn moved(mut schedule: Schedule, rank: usize, action: Action, before: Action) -> Schedule {
        let list = &mut schedule.actions[rank];
        list.retain(|&a| a != action);
        let at = list.iter().position(|&a| a == before).expect("the action to move before");
        list.insert(at, action);
        super::super::simulate(&schedule, super::super::Costs::default()).unwrap();
        schedule
    }

    /// 1F1B on two ranks with each exchange beside its compute: rank 0 sends micro-batch 1's
    /// activation while rank 1 sends micro-batch 0's gradient, and neither receives.
    #[test]
    fn exchanges_beside_their_computes_hang_1f1b() {
        let built = Schedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        check_p2p_order(&built).unwrap();
        // Rank 1 receives micro-batch 1's activation before sending micro-batch 0's gradient.
        let (receive, forward) = (Action::RecvActivation(s(1)), Action::Forward(s(1)));
        let pos = |a: Action| built.actions[1].iter().position(|&b| b == a).unwrap();
        assert!(pos(receive) < pos(Action::SendGrad(s(0))), "{:?}", built.actions[1]);
        let beside = moved(built, 1, receive, forward);
        for first_step in [true, false] {
            let err = play(&beside, first_step, false).unwrap_err().to_string();
            assert!(err.contains("hangs on NCCL"), "{err}");
            assert!(err.contains("send to rank 1 (activation of micro-batch 1 after stage 0)"), "{err}");
            assert!(err.contains("send to rank 0 (gradient of micro-batch 0 after stage 0)"), "{err}");
        }
    }

    /// Tags do not match messages on NCCL: receiving two activations in the other order would
    /// fill each buffer with the other's data.
    #[test]
    fn messages_received_out_of_order_are_named() {
        let built = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
        let swapped = moved(built, 1, Action::RecvActivation(s(1)), Action::RecvActivation(s(0)));
        let err = check_p2p_order(&swapped).unwrap_err().to_string();
        assert!(
            err.contains(
                "the message 1 rank 0 sends to rank 1 is activation of micro-batch 0 after stage 0 but rank 1 receives \
                 it as activation of micro-batch 1 after stage 0"
            ),
            "{err}"
        );
    }

    /// In the first step the host stops where a pair's communicator is created and where it
    /// reads a chunk's first shape header. On three ranks, rank 0 posting the receive of its
    /// second chunk's input (from rank 2) before sending its first chunk's output (to rank 1)
    /// is harmless once the shapes are known and the pairs connected (the two go to different
    /// peers), but in the first step rank 0's host waits there for rank 2, which waits for rank
    /// 1, which waits for that very output.
    #[test]
    fn the_first_step_stops_the_host() {
        let built = Schedule::new(ScheduleKind::Interleaved, 3, 1, 2).unwrap();
        let receive = Action::RecvActivation(Step { micro: 0, chunk: 1 });
        assert_eq!(built.actions[0][..2], [Action::Forward(s(0)), Action::SendActivation(s(0))]);
        let early = moved(built, 0, receive, Action::SendActivation(s(0)));
        play(&early, false, false).unwrap();
        play(&early, false, true).unwrap();
        let err = play(&early, true, false).unwrap_err().to_string();
        assert!(err.contains("hangs on NCCL"), "{err}");
        for (rank, peer) in [(0, 2), (1, 0), (2, 1)] {
            let waits = format!("rank {rank} at F(micro 0, chunk ");
            let stop = err.split("; ").find(|part| part.contains(&waits)).unwrap_or_else(|| panic!("{err}"));
            assert!(stop.ends_with(&format!("its host creating the communicator with rank {peer}")), "{err}");
        }
        assert!(err.contains("receive from rank 2 (shape header after stage 2)"), "{err}");
    }

    /// NCCL connects each direction of a pair at its first exchange that way, holding both
    /// hosts. Rank 2 receiving micro-batch 0's gradient from rank 0 early (before its backward
    /// of chunk 1, which that gradient needs) is harmless once connected, but in the first step
    /// its host waits there for rank 0's first send to it: that very gradient.
    #[test]
    fn each_direction_connects_at_its_first_exchange() {
        let mut early = Schedule::new(ScheduleKind::Interleaved, 3, 3, 2).unwrap();
        let receive = Action::RecvGrad(s(0));
        let list = &mut early.actions[2];
        list.retain(|&a| a != receive);
        let after = list.iter().position(|&a| a == Action::SendActivation(s(2))).unwrap();
        list.insert(after + 1, receive);
        super::super::simulate(&early, super::super::Costs::default()).unwrap();
        play(&early, false, false).unwrap();
        let err = play(&early, true, false).unwrap_err().to_string();
        assert!(err.contains("hangs on NCCL (first step)"), "{err}");
        assert!(err.contains("its host connecting from rank 0"), "{err}");
    }

    /// Hand-written lists are checked before they are walked: an exchange where no neighbour
    /// is, or a chunk the schedule does not have, is an error naming it, not a panic.
    #[test]
    fn impossible_exchanges_are_named() {
        let mut bad = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        bad.actions[0].insert(0, Action::RecvActivation(s(0)));
        for err in [
            check_p2p_order(&bad).unwrap_err(),
            super::super::simulate(&bad, super::super::Costs::default()).unwrap_err(),
        ] {
            let err = err.to_string();
            assert!(
                err.contains("rank 0 has recv-act(micro 0, chunk 0) on stage 0, which has no neighbour there"),
                "{err}"
            );
        }
        let mut bad = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        bad.actions[1].push(Action::Weight(Step { micro: 0, chunk: 1 }));
        let err = check_p2p_order(&bad).unwrap_err().to_string();
        assert!(err.contains("rank 1 has W(micro 0, chunk 1), beyond its 1 chunks and 1 micro-batches"), "{err}");
        let empty = Schedule::from_actions(ScheduleKind::GPipe, 1, 0, false, vec![vec![]]);
        let err = super::super::simulate(&empty, super::super::Costs::default()).unwrap_err().to_string();
        assert!(err.contains("virtual_stages=0 must be at least 1"), "{err}");
    }
}
