//! Checks a schedule's exchanges under NCCL's point-to-point rules, which are stricter than
//! Gloo's (the rules the simulator and the CPU tests follow):
//! - tags are ignored: the k-th send from rank a to rank b fills the k-th receive b posts from
//!   a, whatever message each was meant to be;
//! - each pair of ranks has one stream per side, and a transfer larger than NCCL's staging
//!   buffer completes only when both sides' operations run at once: a send at the head of one
//!   side's stream waits for the matching receive to reach the head of the other's;
//! - an operation's stream first waits for the compute queued before it (the tensor it sends or
//!   overwrites), and a compute waits for the receive it consumes, but the host runs ahead;
//! - except at a chunk's first activation, whose shape header the host reads before it goes on
//!   (the header crosses on the same streams, just before the activation);
//! - and, in the first step, at the first operation between two ranks: NCCL creates the pair's
//!   communicator then, which holds each host until the other reaches its own first operation
//!   with it.
//!
//! [`check_p2p_order`] plays every rank's list on that model of the GPUs and reports a message
//! that would arrive in the wrong buffer, or a cycle of waits (a hang), naming what each rank
//! waits for.
use std::collections::{BTreeMap, HashSet, VecDeque};

use super::schedule::{Action, Schedule};
use crate::{Error, Result};

/// What crosses a boundary: micro-batch `micro`'s activation or gradient across the boundary
/// after virtual stage `stage`, or that boundary's shape header.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Message {
    Data { micro: usize, stage: usize, grad: bool },
    Header { stage: usize },
}

/// One operation on a pair's stream.
#[derive(Clone, Copy, Debug)]
struct Op {
    /// Position in the rank's list of the action that issues it (the host issues in order).
    at: usize,
    send: bool,
    peer: usize,
    message: Message,
}

impl Op {
    fn describe(&self) -> String {
        let (verb, direction) = if self.send { ("send", "to") } else { ("receive", "from") };
        format!("{verb} {direction} rank {} ({})", self.peer, describe(self.message))
    }
}

/// One rank on the model: its streams and how far its host and its computes got.
struct Rank {
    /// Operations per peer, in issue order (ordered by peer, so messages are too).
    streams: BTreeMap<usize, VecDeque<Op>>,
    /// Each compute action's list position, and the position of the receive it consumes.
    computes: Vec<(usize, Option<usize>)>,
    /// List positions of the receives whose shape header the host reads before going on.
    blocking: Vec<usize>,
    /// In the first step, per peer, the list position of the first operation with it, until the
    /// pair's communicator exists.
    connecting: BTreeMap<usize, usize>,
    /// Computes run, headers read, and the data receives completed (by list position).
    computed: usize,
    headers_read: usize,
    received: HashSet<usize>,
}

impl Rank {
    fn new(schedule: &Schedule, r: usize, first_step: bool) -> Rank {
        let (p, list) = (schedule.pp, &schedule.actions[r]);
        let mut rank = Rank {
            streams: BTreeMap::new(),
            computes: Vec::new(),
            blocking: Vec::new(),
            connecting: BTreeMap::new(),
            computed: 0,
            headers_read: 0,
            received: HashSet::new(),
        };
        let (mut headers_sent, mut headers_received) = (HashSet::new(), HashSet::new());
        for (at, a) in list.iter().enumerate() {
            let mut push = |send: bool, peer: usize, message: Message| {
                rank.streams.entry(peer).or_default().push_back(Op { at, send, peer, message });
            };
            match *a {
                Action::Forward(s) | Action::Backward(s) | Action::Weight(s) => {
                    let wanted = match *a {
                        Action::Forward(_) => Some(Action::RecvActivation(s)),
                        Action::Backward(_) => Some(Action::RecvGrad(s)),
                        _ => None,
                    };
                    rank.computes.push((at, wanted.and_then(|w| list[..at].iter().position(|&b| b == w))));
                }
                Action::SendActivation(s) => {
                    let stage = schedule.stage_of(r, s.chunk);
                    if first_step && headers_sent.insert(s.chunk) {
                        push(true, (stage + 1) % p, Message::Header { stage });
                    }
                    push(true, (stage + 1) % p, Message::Data { micro: s.micro, stage, grad: false });
                }
                Action::RecvActivation(s) => {
                    let stage = schedule.stage_of(r, s.chunk) - 1;
                    if first_step && headers_received.insert(s.chunk) {
                        push(false, stage % p, Message::Header { stage });
                        rank.blocking.push(at);
                    }
                    push(false, stage % p, Message::Data { micro: s.micro, stage, grad: false });
                }
                Action::SendGrad(s) => {
                    let stage = schedule.stage_of(r, s.chunk) - 1;
                    push(true, stage % p, Message::Data { micro: s.micro, stage, grad: true });
                }
                Action::RecvGrad(s) => {
                    let stage = schedule.stage_of(r, s.chunk);
                    push(false, (stage + 1) % p, Message::Data { micro: s.micro, stage, grad: true });
                }
            }
        }
        if first_step {
            rank.connecting = rank.streams.iter().filter_map(|(&peer, ops)| Some((peer, ops.front()?.at))).collect();
        }
        rank
    }

    /// The list position the host has not passed: the first header it has yet to read.
    fn host_at(&self) -> usize {
        self.blocking.get(self.headers_read).copied().unwrap_or(usize::MAX)
    }

    /// The list position of the first operation whose communicator does not exist yet: the
    /// host issues nothing from there on until it does.
    fn connect_at(&self) -> usize {
        self.connecting.values().copied().min().unwrap_or(usize::MAX)
    }

    /// Whether the host waits to connect to `peer` (it reached its first operation with it).
    fn waits_to_connect(&self, peer: usize) -> bool {
        self.connecting.get(&peer).is_some_and(|&at| at == self.connect_at() && at <= self.host_at())
    }

    /// Runs the computes whose receives are in; whether any ran.
    fn run_computes(&mut self) -> bool {
        let before = self.computed;
        while let Some(&(at, input)) = self.computes.get(self.computed) {
            if at >= self.host_at().min(self.connect_at()) || input.is_some_and(|i| !self.received.contains(&i)) {
                break;
            }
            self.computed += 1;
        }
        self.computed > before
    }

    /// The head of the stream to `peer`, if the host issued it and the computes queued before
    /// it ran (a header receive is issued with its action, ahead of that action's data).
    fn ready_head(&self, peer: usize) -> Option<Op> {
        let op = *self.streams.get(&peer)?.front()?;
        let host = self.host_at();
        let issued = op.at < self.connect_at()
            && (op.at < host || (op.at == host && matches!(op.message, Message::Header { .. })));
        let computes_done = self.computes.get(self.computed).is_none_or(|&(next, _)| next > op.at);
        (issued && computes_done).then_some(op)
    }

    /// Completes the head of the stream to `peer`.
    fn complete_head(&mut self, peer: usize) {
        let op = self.streams.get_mut(&peer).and_then(VecDeque::pop_front).expect("a head to complete");
        match op.message {
            _ if op.send => {}
            Message::Header { .. } => self.headers_read += 1,
            Message::Data { .. } => {
                self.received.insert(op.at);
            }
        }
    }

    fn done(&self) -> bool {
        self.computed == self.computes.len() && self.streams.values().all(VecDeque::is_empty)
    }

    /// Where a stuck rank stands: its next compute and the heads of its streams.
    fn stuck(&self, r: usize, schedule: &Schedule) -> Option<String> {
        if self.done() {
            return None;
        }
        let next = self
            .computes
            .get(self.computed)
            .map_or("its end".to_string(), |&(at, _)| schedule.actions[r][at].to_string());
        let heads: Vec<String> = self.streams.values().filter_map(VecDeque::front).map(Op::describe).collect();
        let heads = if heads.is_empty() { "nothing queued".to_string() } else { heads.join(", ") };
        let connecting = self.connecting.keys().find(|&&peer| self.waits_to_connect(peer));
        let host = connecting.map_or(String::new(), |peer| format!(", its host connecting to rank {peer}"));
        Some(format!("rank {r} at {next} with {heads}{host}"))
    }
}

/// Checks `schedule` on the model above, for a training step whose headers cross (the first
/// step, which has every exchange later steps have, and more) when `first_step`, else for a
/// later one. Errors name the ranks and actions involved.
pub fn check_p2p_order(schedule: &Schedule, first_step: bool) -> Result<()> {
    let p = schedule.pp;
    let mut ranks: Vec<Rank> = (0..p).map(|r| Rank::new(schedule, r, first_step)).collect();
    check_fifo_matching(schedule, &ranks)?;
    loop {
        let mut progressed = false;
        for rank in &mut ranks {
            progressed |= rank.run_computes();
        }
        for a in 0..p {
            for b in a + 1..p {
                if ranks[a].waits_to_connect(b) && ranks[b].waits_to_connect(a) {
                    ranks[a].connecting.remove(&b);
                    ranks[b].connecting.remove(&a);
                    progressed = true;
                }
            }
        }
        // A transfer runs when both sides' heads are ready and one sends what the other
        // receives (the matching above made sure it is the same message).
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
            return Err(Error::invalid(format!(
                "pipeline schedule {} hangs on NCCL: {}",
                schedule.kind.name(),
                stuck.join("; ")
            )));
        }
    }
}

/// NCCL pairs the k-th send from a to b with the k-th receive b posts from a; both must be the
/// same message.
fn check_fifo_matching(schedule: &Schedule, ranks: &[Rank]) -> Result<()> {
    for (a, rank) in ranks.iter().enumerate() {
        for (&b, ops) in &rank.streams {
            let sent = ops.iter().filter(|op| op.send).map(|op| op.message);
            let expected = ranks[b].streams.get(&a).into_iter().flatten().filter(|op| !op.send).map(|op| op.message);
            for (k, (s, e)) in sent.zip(expected).enumerate() {
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

fn describe(m: Message) -> String {
    match m {
        Message::Data { micro, stage, grad: false } => format!("activation of micro-batch {micro} after stage {stage}"),
        Message::Data { micro, stage, grad: true } => format!("gradient of micro-batch {micro} after stage {stage}"),
        Message::Header { stage } => format!("shape header after stage {stage}"),
    }
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
                    for first_step in [true, false] {
                        check_p2p_order(&s, first_step)
                            .unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} v={v} first_step={first_step}: {e}"));
                    }
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
        check_p2p_order(&built, true).unwrap();
        // Rank 1 receives micro-batch 1's activation before sending micro-batch 0's gradient.
        let (receive, forward) = (Action::RecvActivation(s(1)), Action::Forward(s(1)));
        let pos = |a: Action| built.actions[1].iter().position(|&b| b == a).unwrap();
        assert!(pos(receive) < pos(Action::SendGrad(s(0))), "{:?}", built.actions[1]);
        let beside = moved(built, 1, receive, forward);
        for first_step in [true, false] {
            let err = check_p2p_order(&beside, first_step).unwrap_err().to_string();
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
        let err = check_p2p_order(&swapped, false).unwrap_err().to_string();
        assert!(
            err.contains(
                "the message 0 rank 0 sends to rank 1 is activation of micro-batch 0 after stage 0 but rank 1 receives \
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
        check_p2p_order(&early, false).unwrap();
        let err = check_p2p_order(&early, true).unwrap_err().to_string();
        assert!(err.contains("hangs on NCCL"), "{err}");
        for (rank, peer) in [(0, 2), (1, 0), (2, 1)] {
            let waits = format!("rank {rank} at F(micro 0, chunk ");
            let stop = err.split("; ").find(|part| part.contains(&waits)).unwrap_or_else(|| panic!("{err}"));
            assert!(stop.ends_with(&format!("its host connecting to rank {peer}")), "{err}");
        }
        assert!(err.contains("receive from rank 2 (shape header after stage 2)"), "{err}");
    }
}
