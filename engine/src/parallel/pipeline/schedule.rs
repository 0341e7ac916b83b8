//! Pipeline schedules as data: for each rank, the ordered list of actions it performs in one
//! training step. One function per schedule produces the compute order; [`Schedule::new`] adds
//! the sends and receives between neighbouring virtual stages. The same lists drive the
//! runtime ([`super::Pipeline`]) and the simulator ([`super::simulate()`]), so what is measured is
//! what runs.
//!
//! Virtual stages: with `v` chunks per rank the model is cut into `pp * v` pieces, and chunk `c`
//! of rank `r` is virtual stage `c * pp + r` (Megatron's interleaved layout), so consecutive
//! virtual stages sit on consecutive ranks and every boundary is a neighbour exchange.
use std::collections::HashSet;
use std::fmt;

use crate::error::ensure;
use crate::Result;

/// Which schedule to build; as a command-line value `gpipe`, `1f1b`, `interleaved` or `zb`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019): holds every micro-batch.
    #[value(name = "gpipe")]
    GPipe,
    /// One forward, one backward after a warm-up (PipeDream-flush): holds at most `pp`.
    #[value(name = "1f1b")]
    OneFOneB,
    /// 1F1B over `v` virtual stages per rank (Narayanan et al. 2021): the bubble shrinks by `v`.
    Interleaved,
    /// ZB-H1 (Qi et al. 2023): the backward split into an input-gradient pass, on the critical
    /// path, and a weight-gradient pass deferred to fill the bubble; 1F1B's memory bound.
    #[value(name = "zb")]
    ZeroBubbleH1,
}

impl ScheduleKind {
    /// The name used in messages and tables.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
        }
    }
}

/// A micro-batch on one of this rank's chunks (chunk `c` is virtual stage `c * pp + rank`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Step {
    /// Micro-batch index.
    pub micro: usize,
    /// Chunk index on this rank (0 unless interleaved).
    pub chunk: usize,
}

/// What crosses between neighbouring virtual stages: micro-batch `micro`'s activation (forward)
/// or gradient (backward, `grad`) across the boundary after virtual stage `boundary`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Message {
    pub micro: usize,
    pub boundary: usize,
    pub grad: bool,
}

/// One thing a rank does. Sends and receives are posted without blocking (sends are waited for
/// at the end of the step; in the first step a chunk's first activation receive reads its shape
/// header first); the compute that consumes a receive waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Receive this step's input activation from the previous virtual stage.
    RecvActivation(Step),
    /// Forward of the chunk on the micro-batch.
    Forward(Step),
    /// Send the output activation to the next virtual stage.
    SendActivation(Step),
    /// Receive the gradient of the output from the next virtual stage.
    RecvGrad(Step),
    /// Backward: the input gradient, and the weight gradients too unless the schedule splits
    /// the backward (then they come with [`Action::Weight`]).
    Backward(Step),
    /// Send the input gradient to the previous virtual stage.
    SendGrad(Step),
    /// The deferred weight-gradient pass of a split backward.
    Weight(Step),
}

impl Action {
    /// The micro-batch and chunk the action is about.
    pub fn step(&self) -> Step {
        match *self {
            Action::RecvActivation(s)
            | Action::Forward(s)
            | Action::SendActivation(s)
            | Action::RecvGrad(s)
            | Action::Backward(s)
            | Action::SendGrad(s)
            | Action::Weight(s) => s,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, s) = match *self {
            Action::RecvActivation(s) => ("recv-act", s),
            Action::Forward(s) => ("F", s),
            Action::SendActivation(s) => ("send-act", s),
            Action::RecvGrad(s) => ("recv-grad", s),
            Action::Backward(s) => ("B", s),
            Action::SendGrad(s) => ("send-grad", s),
            Action::Weight(s) => ("W", s),
        };
        write!(f, "{name}(micro {}, chunk {})", s.micro, s.chunk)
    }
}

/// A complete schedule: every rank's actions for one step.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Which schedule this is.
    pub kind: ScheduleKind,
    /// Pipeline ranks.
    pub pp: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Chunks (virtual stages) per rank.
    pub virtual_stages: usize,
    /// Whether backward is split into [`Action::Backward`] (input gradient) and
    /// [`Action::Weight`].
    pub split_backward: bool,
    /// `actions[rank]`: that rank's list, in order.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Builds `kind` for `pp` ranks, `micro_batches` micro-batches and `virtual_stages` chunks
    /// per rank (1 for every schedule but [`ScheduleKind::Interleaved`], which needs 2 or more).
    pub fn new(kind: ScheduleKind, pp: usize, micro_batches: usize, virtual_stages: usize) -> Result<Schedule> {
        let (p, m, v) = (pp, micro_batches, virtual_stages);
        ensure!(p >= 1, "pipeline: pp={p} must be at least 1");
        ensure!(m >= 1, "pipeline: micro_batches={m} must be at least 1");
        match kind {
            ScheduleKind::Interleaved => {
                ensure!(
                    v >= 2 && p >= 2,
                    "pipeline: the interleaved schedule needs virtual_stages >= 2 and pp >= 2, got virtual_stages={v} \
                     pp={p}"
                );
                // A partial group of micro-batches after full ones deadlocks this order (the
                // simulator finds it); Megatron-LM makes the same demand.
                ensure!(
                    m < p || m.is_multiple_of(p),
                    "pipeline: the interleaved schedule needs micro_batches={m} to be a multiple of pp={p} (or fewer \
                     than pp)"
                );
            }
            _ => ensure!(v == 1, "pipeline: {} takes virtual_stages=1, got {v}", kind.name()),
        }
        let compute: Vec<Vec<Action>> = (0..p)
            .map(|r| match kind {
                ScheduleKind::GPipe => gpipe(m),
                ScheduleKind::OneFOneB => one_f_one_b(p, r, m),
                ScheduleKind::Interleaved => interleaved(p, r, m, v),
                ScheduleKind::ZeroBubbleH1 => zb_h1(p, r, m),
            })
            .collect();
        let split_backward = kind == ScheduleKind::ZeroBubbleH1;
        let actions = with_communication(&compute, p, v)?;
        Ok(Schedule { kind, pp: p, micro_batches: m, virtual_stages: v, split_backward, actions })
    }

    /// Builds a schedule from hand-written per-rank lists (compute and communication), for
    /// experiments and for checking that the simulator refuses bad orders.
    pub fn from_actions(
        kind: ScheduleKind,
        micro_batches: usize,
        virtual_stages: usize,
        split_backward: bool,
        actions: Vec<Vec<Action>>,
    ) -> Schedule {
        Schedule { kind, pp: actions.len(), micro_batches, virtual_stages, split_backward, actions }
    }

    /// Number of virtual stages, `pp * virtual_stages`.
    pub fn stages(&self) -> usize {
        self.pp * self.virtual_stages
    }

    /// The virtual stage of `chunk` on `rank`.
    pub fn stage_of(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.pp + rank
    }

    /// The message `rank`'s action `a` sends or receives or, for a compute, consumes (a forward
    /// its input, a backward its output's gradient); `None` for the first stage's forwards, the
    /// last stage's backwards and weight passes. The list must have passed
    /// [`Schedule::check_stages`].
    pub(super) fn message(&self, rank: usize, a: Action) -> Option<Message> {
        let s = a.step();
        let stage = self.stage_of(rank, s.chunk);
        let (boundary, grad) = match a {
            Action::SendActivation(_) => (stage, false),
            Action::RecvActivation(_) => (stage - 1, false),
            Action::Forward(_) if stage > 0 => (stage - 1, false),
            Action::SendGrad(_) => (stage - 1, true),
            Action::RecvGrad(_) => (stage, true),
            Action::Backward(_) if stage + 1 < self.stages() => (stage, true),
            _ => return None,
        };
        Some(Message { micro: s.micro, boundary, grad })
    }

    /// Checks what hand-written lists ([`Schedule::from_actions`]) may get wrong before
    /// anything walks them: at least one rank and one chunk per rank, every action's chunk and
    /// micro-batch within the schedule's, and exchanges only where a neighbouring stage is
    /// (nothing before the first stage or after the last).
    pub fn check_stages(&self) -> Result<()> {
        ensure!(
            self.pp >= 1 && self.virtual_stages >= 1,
            "pipeline schedule {}: pp={} and virtual_stages={} must be at least 1",
            self.kind.name(),
            self.pp,
            self.virtual_stages
        );
        let last = self.stages() - 1;
        for (rank, list) in self.actions.iter().enumerate() {
            for a in list {
                let s = a.step();
                ensure!(
                    s.chunk < self.virtual_stages && s.micro < self.micro_batches,
                    "pipeline schedule {}: rank {rank} has {a}, beyond its {} chunks and {} micro-batches",
                    self.kind.name(),
                    self.virtual_stages,
                    self.micro_batches
                );
                let stage = self.stage_of(rank, s.chunk);
                let beyond = match a {
                    Action::RecvActivation(_) | Action::SendGrad(_) => stage == 0,
                    Action::SendActivation(_) | Action::RecvGrad(_) => stage == last,
                    _ => false,
                };
                ensure!(
                    !beyond,
                    "pipeline schedule {}: rank {rank} has {a} on stage {stage}, which has no neighbour there",
                    self.kind.name()
                );
            }
        }
        Ok(())
    }
}

fn forward(micro: usize, chunk: usize) -> Action {
    Action::Forward(Step { micro, chunk })
}

fn backward(micro: usize, chunk: usize) -> Action {
    Action::Backward(Step { micro, chunk })
}

/// GPipe: every forward, then every backward, in micro-batch order.
fn gpipe(m: usize) -> Vec<Action> {
    (0..m).map(|i| forward(i, 0)).chain((0..m).map(|i| backward(i, 0))).collect()
}

/// 1F1B: rank `r` runs `pp - r - 1` forwards ahead, then alternates one forward and one
/// backward, then drains the remaining backwards; it never holds more than `pp - r`.
fn one_f_one_b(p: usize, r: usize, m: usize) -> Vec<Action> {
    let warmup = (p - r - 1).min(m);
    let mut list: Vec<Action> = (0..warmup).map(|i| forward(i, 0)).collect();
    for i in 0..m - warmup {
        list.push(forward(warmup + i, 0));
        list.push(backward(i, 0));
    }
    list.extend((m - warmup..m).map(|i| backward(i, 0)));
    list
}

/// ZB-H1: 1F1B's order of forwards and input-gradient passes; rank `r` holds back its weight
/// passes by `r` backwards, so that the later ranks, which start late, spend the end of the step
/// on weight passes while the input gradients travel on to the first ranks. The first rank still
/// holds at most `pp` micro-batches (its weight passes are not deferred), as 1F1B.
fn zb_h1(p: usize, r: usize, m: usize) -> Vec<Action> {
    let mut list = Vec::with_capacity(3 * m);
    let mut weights = 0;
    for a in one_f_one_b(p, r, m) {
        list.push(a);
        if let Action::Backward(s) = a {
            if s.micro >= r {
                list.push(Action::Weight(Step { micro: weights, chunk: 0 }));
                weights += 1;
            }
        }
    }
    list.extend((weights..m).map(|i| Action::Weight(Step { micro: i, chunk: 0 })));
    list
}

/// Interleaved 1F1B (Megatron-LM): micro-batches go through the chunks in groups of `pp`
/// (forward: chunk 0 for the group, then chunk 1, ...; backward: the chunks in reverse), with
/// `2 (pp - r - 1) + (v - 1) pp` forwards of warm-up. With fewer micro-batches than `pp` the
/// one group is smaller; otherwise `pp` divides them ([`Schedule::new`] checks).
fn interleaved(p: usize, r: usize, m: usize, v: usize) -> Vec<Action> {
    let order = |reverse: bool| -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(m * v);
        for start in (0..m).step_by(p) {
            let group = start..(start + p).min(m);
            for c in 0..v {
                let chunk = if reverse { v - 1 - c } else { c };
                out.extend(group.clone().map(|i| (i, chunk)));
            }
        }
        out
    };
    let (fwd, bwd) = (order(false), order(true));
    let total = m * v;
    let warmup = (2 * (p - r - 1) + (v - 1) * p).min(total);
    let mut list: Vec<Action> = fwd[..warmup].iter().map(|&(i, c)| forward(i, c)).collect();
    for k in 0..total - warmup {
        let (i, c) = fwd[warmup + k];
        list.push(forward(i, c));
        let (i, c) = bwd[k];
        list.push(backward(i, c));
    }
    list.extend(bwd[total - warmup..].iter().map(|&(i, c)| backward(i, c)));
    list
}

/// Adds the exchanges to every rank's compute order, placing them in one order that every
/// pair of ranks agrees on. NCCL needs that (see [`super::check_p2p_order`]): it ignores tags,
/// pairing the k-th send to a peer with the k-th receive from it, and each pair's transfers run
/// in one queue per side, so two ranks that each send the other something large before
/// receiving wait on each other forever (1F1B's steady state would, with each exchange placed
/// beside its compute, for activations larger than NCCL's buffer).
///
/// The order comes from playing the schedule in rounds: in each round every rank runs its next
/// compute if its input has arrived, then each message that a compute of the round produced is
/// delivered at once, as a send on its rank's list and a receive on the receiving rank's list.
/// Both sides of every pair of ranks thus list their exchanges in the order of one run of the
/// whole schedule. A receive lands where its message arrived in that run, which is at or before
/// the compute that needs it (the compute waits for it, the receive itself does not); a send
/// follows the compute that produced it within the same round. The first and last virtual stages
/// skip the missing side. Errors: a compute order that waits on itself.
fn with_communication(compute: &[Vec<Action>], p: usize, v: usize) -> Result<Vec<Vec<Action>>> {
    let last = p * v - 1;
    let step_at = |stage: usize, micro: usize| Step { micro, chunk: stage / p };
    let mut out: Vec<Vec<Action>> = compute.iter().map(|c| Vec::with_capacity(c.len() * 3)).collect();
    let mut next = vec![0usize; p];
    // Receives delivered, by receiving rank, not yet consumed by their compute.
    let mut arrived: HashSet<(usize, Action)> = HashSet::new();
    while (0..p).any(|r| next[r] < compute[r].len()) {
        let mut delivered = Vec::new();
        let mut progressed = false;
        for r in 0..p {
            let Some(&a) = compute[r].get(next[r]) else { continue };
            let stage = |s: &Step| s.chunk * p + r;
            let input = match a {
                Action::Forward(s) if stage(&s) > 0 => Some(Action::RecvActivation(s)),
                Action::Backward(s) if stage(&s) < last => Some(Action::RecvGrad(s)),
                _ => None,
            };
            if input.is_some_and(|i| !arrived.remove(&(r, i))) {
                continue;
            }
            out[r].push(a);
            next[r] += 1;
            progressed = true;
            match a {
                Action::Forward(s) if stage(&s) < last => {
                    let to = stage(&s) + 1;
                    delivered.push((
                        r,
                        Action::SendActivation(s),
                        to % p,
                        Action::RecvActivation(step_at(to, s.micro)),
                    ));
                }
                Action::Backward(s) if stage(&s) > 0 => {
                    let to = stage(&s) - 1;
                    delivered.push((r, Action::SendGrad(s), to % p, Action::RecvGrad(step_at(to, s.micro))));
                }
                _ => {}
            }
        }
        // Only a compute delivers, so a round without deliveries or computes is a cycle.
        ensure!(progressed, "pipeline: the compute orders wait on each other");
        for (from, send, to, receive) in delivered {
            out[from].push(send);
            out[to].push(receive);
            arrived.insert((to, receive));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn computes(list: &[Action]) -> Vec<String> {
        list.iter()
            .filter(|a| matches!(a, Action::Forward(_) | Action::Backward(_) | Action::Weight(_)))
            .map(|a| {
                let s = match a {
                    Action::Forward(s) | Action::Backward(s) | Action::Weight(s) => s,
                    _ => unreachable!(),
                };
                let k = match a {
                    Action::Forward(_) => "F",
                    Action::Backward(_) => "B",
                    _ => "W",
                };
                format!("{k}{}{}", s.micro, if s.chunk > 0 { format!(".{}", s.chunk) } else { String::new() })
            })
            .collect()
    }

    #[test]
    fn one_f_one_b_warms_up_by_rank() {
        let s = Schedule::new(ScheduleKind::OneFOneB, 4, 6, 1).unwrap();
        assert_eq!(computes(&s.actions[0]).join(" "), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
        assert_eq!(computes(&s.actions[3]).join(" "), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
        // The first stage receives nothing and the last sends no activation.
        assert!(!s.actions[0].iter().any(|a| matches!(a, Action::RecvActivation(_) | Action::SendGrad(_))));
        assert!(!s.actions[3].iter().any(|a| matches!(a, Action::SendActivation(_) | Action::RecvGrad(_))));
    }

    #[test]
    fn zb_h1_defers_weight_passes_by_rank() {
        let s = Schedule::new(ScheduleKind::ZeroBubbleH1, 2, 3, 1).unwrap();
        assert_eq!(computes(&s.actions[0]).join(" "), "F0 F1 B0 W0 F2 B1 W1 B2 W2");
        assert_eq!(computes(&s.actions[1]).join(" "), "F0 B0 F1 B1 W0 F2 B2 W1 W2");
    }

    #[test]
    fn interleaved_visits_chunks_in_groups() {
        let s = Schedule::new(ScheduleKind::Interleaved, 2, 2, 2).unwrap();
        assert_eq!(computes(&s.actions[0]).join(" "), "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1");
        let every = |kind: ScheduleKind, m: usize, v: usize| {
            let s = Schedule::new(kind, 4, m, v).unwrap();
            for list in &s.actions {
                let c = computes(list);
                assert_eq!(c.len(), m * v * if s.split_backward { 3 } else { 2 }, "{kind:?} m={m}");
            }
        };
        for m in [1, 3, 4, 7, 12] {
            every(ScheduleKind::GPipe, m, 1);
            every(ScheduleKind::OneFOneB, m, 1);
            every(ScheduleKind::ZeroBubbleH1, m, 1);
            if m < 4 || m.is_multiple_of(4) {
                every(ScheduleKind::Interleaved, m, 2);
                every(ScheduleKind::Interleaved, m, 3);
            }
        }
    }

    #[test]
    fn bad_sizes_are_errors_naming_them() {
        let err = Schedule::new(ScheduleKind::Interleaved, 4, 8, 1).unwrap_err().to_string();
        assert!(err.contains("virtual_stages=1"), "{err}");
        let err = Schedule::new(ScheduleKind::GPipe, 4, 8, 2).unwrap_err().to_string();
        assert!(err.contains("gpipe takes virtual_stages=1, got 2"), "{err}");
        let err = Schedule::new(ScheduleKind::Interleaved, 4, 6, 2).unwrap_err().to_string();
        assert!(err.contains("micro_batches=6 to be a multiple of pp=4"), "{err}");
        let err = Schedule::new(ScheduleKind::OneFOneB, 4, 0, 1).unwrap_err().to_string();
        assert!(err.contains("micro_batches=0"), "{err}");
    }
}
