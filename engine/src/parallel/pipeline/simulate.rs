//! Runs a [`Schedule`]'s action lists on a model of the machine: each rank executes its list in
//! order, compute actions take fixed times, sends and receives take none and never block, and
//! the compute that consumes a receive waits until the matching send has been posted (plus a
//! hop's transfer time, zero in the textbook model), exactly the runtime's rules on Gloo
//! (NCCL's stricter ones are checked apart, by [`super::check_p2p_order`]). Costs may differ per
//! rank ([`simulate_ranks`]), as measured stages do. From the timeline come the bubble fraction
//! and the peak number of micro-batches each rank holds; a schedule whose ranks wait on each
//! other forever is reported as a deadlock, naming what each rank waits for.
use std::collections::{HashMap, HashSet};
use std::fmt;

use super::schedule::{Action, Message, Schedule, Step};
use crate::{Error, Result};

/// Time of one chunk's passes, and of a message between neighbouring stages. Textbook analyses
/// take `forward = input_grad = weight_grad` and `hop = 0`; an unsplit backward costs
/// `input_grad + weight_grad`.
#[derive(Clone, Copy, Debug)]
pub struct Costs {
    /// A forward.
    pub forward: f64,
    /// The input-gradient half of a backward.
    pub input_grad: f64,
    /// The weight-gradient half of a backward.
    pub weight_grad: f64,
    /// From a send's posting to the message being received (charged to the receiver).
    pub hop: f64,
}

impl Default for Costs {
    fn default() -> Costs {
        Costs { forward: 1.0, input_grad: 1.0, weight_grad: 1.0, hop: 0.0 }
    }
}

/// What a simulated step looks like.
#[derive(Clone, Debug)]
pub struct Simulation {
    /// Time until the last rank finishes.
    pub makespan: f64,
    /// Idle time over total rank time: `1 - busy / (pp * makespan)`.
    pub bubble: f64,
    /// Per rank, the most micro-batch chunks held at once (forward done, last backward pass
    /// not yet).
    pub peak_in_flight: Vec<usize>,
}

impl fmt::Display for Simulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "makespan {:.1}, bubble {:.4}, peak in flight per rank {:?}",
            self.makespan, self.bubble, self.peak_in_flight
        )
    }
}

/// Simulates `schedule` under `costs` on every rank. Errors: a deadlock (naming each stuck
/// rank's action), a send nobody receives, or a compute action repeated or missing.
pub fn simulate(schedule: &Schedule, costs: Costs) -> Result<Simulation> {
    simulate_ranks(schedule, &vec![costs; schedule.pp])
}

/// Simulates `schedule` with rank `r`'s chunks costing `costs[r]` (e.g. each rank's measured
/// means, [`super::StepStats::costs`]); errors as [`simulate`], and for a wrong number of costs.
pub fn simulate_ranks(schedule: &Schedule, costs: &[Costs]) -> Result<Simulation> {
    let p = schedule.pp;
    if costs.len() != p {
        return Err(Error::invalid(format!("pipeline simulation: {} costs for pp={p} ranks", costs.len())));
    }
    schedule.check_stages()?;
    let backward_cost = |c: &Costs| if schedule.split_backward { c.input_grad } else { c.input_grad + c.weight_grad };
    let mut next = vec![0usize; p];
    let mut clock = vec![0.0f64; p];
    let mut busy = vec![0.0f64; p];
    let mut held = vec![0usize; p];
    let mut peak = vec![0usize; p];
    let mut posted: HashMap<Message, f64> = HashMap::new();
    // Per rank, the receives posted and not yet consumed.
    let mut pending: Vec<HashSet<Message>> = vec![HashSet::new(); p];
    let mut received = 0usize;
    loop {
        let mut progressed = false;
        for r in 0..p {
            while let Some(a) = schedule.actions[r].get(next[r]) {
                if let (Action::Forward(_) | Action::Backward(_), Some(m)) = (a, schedule.message(r, *a)) {
                    if !pending[r].contains(&m) {
                        return Err(Error::invalid(format!(
                            "pipeline simulation: rank {r} runs {a} before its receive"
                        )));
                    }
                    let Some(&sent) = posted.get(&m) else { break };
                    clock[r] = clock[r].max(sent + costs[r].hop);
                    pending[r].remove(&m);
                    received += 1;
                }
                let cost = match a {
                    Action::Forward(_) => {
                        held[r] += 1;
                        peak[r] = peak[r].max(held[r]);
                        costs[r].forward
                    }
                    Action::Backward(_) => {
                        if !schedule.split_backward {
                            held[r] -= 1;
                        }
                        backward_cost(&costs[r])
                    }
                    Action::Weight(_) => {
                        held[r] -= 1;
                        costs[r].weight_grad
                    }
                    Action::SendActivation(_) | Action::SendGrad(_) => {
                        let m = schedule.message(r, *a).expect("a send is a message");
                        if posted.insert(m, clock[r]).is_some() {
                            return Err(Error::invalid(format!("pipeline simulation: rank {r} sends {a} twice")));
                        }
                        0.0
                    }
                    Action::RecvActivation(_) | Action::RecvGrad(_) => {
                        let m = schedule.message(r, *a).expect("a receive is a message");
                        if !pending[r].insert(m) {
                            return Err(Error::invalid(format!("pipeline simulation: rank {r} posts {a} twice")));
                        }
                        0.0
                    }
                };
                clock[r] += cost;
                busy[r] += cost;
                next[r] += 1;
                progressed = true;
            }
        }
        if next.iter().enumerate().all(|(r, &n)| n == schedule.actions[r].len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..p)
                .filter_map(|r| schedule.actions[r].get(next[r]).map(|a| format!("rank {r} waits in {a}")))
                .collect();
            return Err(Error::invalid(format!(
                "pipeline schedule {} deadlocks: {}",
                schedule.kind.name(),
                stuck.join("; ")
            )));
        }
    }
    if received != posted.len() {
        return Err(Error::invalid(format!(
            "pipeline schedule {}: {} messages sent but {received} received",
            schedule.kind.name(),
            posted.len()
        )));
    }
    check_complete(schedule)?;
    let makespan = clock.iter().cloned().fold(0.0, f64::max);
    let bubble = 1.0 - busy.iter().sum::<f64>() / (p as f64 * makespan);
    Ok(Simulation { makespan, bubble, peak_in_flight: peak })
}

/// Every rank runs each pass of each micro-batch on each of its chunks exactly once.
fn check_complete(schedule: &Schedule) -> Result<()> {
    let (m, v) = (schedule.micro_batches, schedule.virtual_stages);
    for (r, list) in schedule.actions.iter().enumerate() {
        let mut counts: HashMap<(u8, Step), usize> = HashMap::new();
        for a in list {
            let key = match *a {
                Action::Forward(s) => (0, s),
                Action::Backward(s) => (1, s),
                Action::Weight(s) => (2, s),
                _ => continue,
            };
            *counts.entry(key).or_default() += 1;
        }
        let kinds: &[u8] = if schedule.split_backward { &[0, 1, 2] } else { &[0, 1] };
        for &k in kinds {
            for micro in 0..m {
                for chunk in 0..v {
                    let n = counts.get(&(k, Step { micro, chunk })).copied().unwrap_or(0);
                    if n != 1 {
                        let pass = ["forward", "backward", "weight pass"][k as usize];
                        return Err(Error::invalid(format!(
                            "pipeline schedule {}: rank {r} runs the {pass} of micro-batch {micro}, chunk {chunk} \
                             {n} times",
                            schedule.kind.name()
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The textbook bubble fraction (idle over total time) for `kind` with uniform chunk costs:
/// `(p - 1) / (v m + p - 1)` for GPipe and 1F1B (`v = 1`) and interleaved 1F1B (the bubble over
/// the ideal time, `(p - 1) / (v m)`, is 1F1B's divided by `v`); for ZB-H1 with
/// `F = B = W` the bubble shrinks from `(p - 1)(F + B + W)` to `(p - 1)(F + B - W)`, giving
/// `(p - 1) / (3 m + p - 1)` (reached once `m >= p`; with fewer micro-batches the schedule
/// cannot fill the bubble with weight passes and does worse, though still better than 1F1B).
pub fn textbook_bubble(kind: super::ScheduleKind, p: usize, m: usize, v: usize) -> f64 {
    let (p, m, v) = (p as f64, m as f64, v as f64);
    match kind {
        super::ScheduleKind::ZeroBubbleH1 => (p - 1.0) / (3.0 * m + p - 1.0),
        _ => (p - 1.0) / (v * m + p - 1.0),
    }
}

/// A markdown table of simulated bubble fractions beside the textbook formula, and the peak
/// micro-batch chunks in flight on the busiest rank (a chunk holds `1 / v` of a rank's layers,
/// so divided by `v` it is in whole micro-batches' activations), for each `(kind, pp, micro_batches,
/// virtual_stages)` (unit costs, `F = B = W`).
pub fn bubble_table(cases: &[(super::ScheduleKind, usize, usize, usize)]) -> Result<String> {
    let mut out = String::from(
        "| schedule | pp | micro-batches | virtual stages | simulated bubble | formula | peak in flight (chunks) | \
         (micro-batches) |\n|---|---|---|---|---|---|---|---|\n",
    );
    for &(kind, p, m, v) in cases {
        let sim = simulate(&Schedule::new(kind, p, m, v)?, Costs::default())?;
        let peak = sim.peak_in_flight.iter().max().copied().unwrap_or(0);
        let formula = textbook_bubble(kind, p, m, v);
        let whole = peak as f64 / v as f64;
        out.push_str(&format!(
            "| {} | {p} | {m} | {v} | {:.4} | {formula:.4} | {peak} | {whole:.2} |\n",
            kind.name(),
            sim.bubble
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::ScheduleKind;
    use super::*;

    fn run(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Simulation {
        simulate(&Schedule::new(kind, p, m, v).unwrap(), Costs::default())
            .unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} v={v}: {e}"))
    }

    #[test]
    fn every_schedule_runs_without_deadlock() {
        for p in [1, 2, 3, 4, 8] {
            for m in 1..=13 {
                run(ScheduleKind::GPipe, p, m, 1);
                run(ScheduleKind::OneFOneB, p, m, 1);
                run(ScheduleKind::ZeroBubbleH1, p, m, 1);
                if p >= 2 && (m < p || m.is_multiple_of(p)) {
                    for v in 2..=4 {
                        run(ScheduleKind::Interleaved, p, m, v);
                    }
                }
            }
        }
    }

    #[test]
    fn bubbles_match_the_formulas() {
        for p in [2, 4, 8] {
            for m in [1, 2, p, 3 * p, 4 * p] {
                for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                    let s = run(kind, p, m, 1);
                    let want = textbook_bubble(kind, p, m, 1);
                    assert!((s.bubble - want).abs() < 1e-9, "{kind:?} p={p} m={m}: {} vs {want}", s.bubble);
                }
                let zb = run(ScheduleKind::ZeroBubbleH1, p, m, 1);
                if m >= p {
                    let want = textbook_bubble(ScheduleKind::ZeroBubbleH1, p, m, 1);
                    assert!((zb.bubble - want).abs() < 1e-9, "zb-h1 p={p} m={m}: {} vs {want}", zb.bubble);
                }
                let one = run(ScheduleKind::OneFOneB, p, m, 1);
                assert!(zb.bubble < one.bubble, "p={p} m={m}: zb-h1 {} vs 1f1b {}", zb.bubble, one.bubble);
                assert!(zb.peak_in_flight.iter().max() <= one.peak_in_flight.iter().max(), "zb-h1 memory, p={p}");
            }
            // Interleaved: the formula holds when pp divides the micro-batches.
            for m in [p, 2 * p, 3 * p] {
                for v in [2, 3, 4] {
                    let s = run(ScheduleKind::Interleaved, p, m, v);
                    let want = textbook_bubble(ScheduleKind::Interleaved, p, m, v);
                    assert!((s.bubble - want).abs() < 1e-9, "interleaved p={p} m={m} v={v}: {} vs {want}", s.bubble);
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_pp_and_gpipe_holds_m() {
        for p in [2, 4] {
            for m in [1, p, 3 * p] {
                let one = run(ScheduleKind::OneFOneB, p, m, 1);
                assert_eq!(one.peak_in_flight, (0..p).map(|r| (p - r).min(m)).collect::<Vec<_>>());
                let gpipe = run(ScheduleKind::GPipe, p, m, 1);
                assert!(gpipe.peak_in_flight.iter().all(|&n| n == m));
            }
        }
    }

    #[test]
    fn the_table_lists_every_case() {
        use ScheduleKind::*;
        let mut cases = Vec::new();
        for (p, m) in [(4, 4), (4, 8), (4, 16), (8, 16)] {
            cases.extend([(GPipe, p, m, 1), (OneFOneB, p, m, 1), (Interleaved, p, m, 2), (Interleaved, p, m, 4)]);
            cases.push((ZeroBubbleH1, p, m, 1));
        }
        let table = bubble_table(&cases).unwrap();
        println!("{table}");
        assert_eq!(table.lines().count(), cases.len() + 2);
    }

    #[test]
    fn a_bad_order_is_a_deadlock_naming_the_ranks() {
        // Rank 0 runs the backward of micro-batch 0 before sending its activation on.
        let s = |micro| Step { micro, chunk: 0 };
        let bad = Schedule::from_actions(
            ScheduleKind::OneFOneB,
            1,
            1,
            false,
            vec![
                vec![
                    Action::Forward(s(0)),
                    Action::RecvGrad(s(0)),
                    Action::Backward(s(0)),
                    Action::SendActivation(s(0)),
                ],
                vec![
                    Action::RecvActivation(s(0)),
                    Action::Forward(s(0)),
                    Action::Backward(s(0)),
                    Action::SendGrad(s(0)),
                ],
            ],
        );
        let err = simulate(&bad, Costs::default()).unwrap_err().to_string();
        assert!(err.contains("deadlocks"), "{err}");
        assert!(err.contains("rank 0 waits in B(micro 0, chunk 0)"), "{err}");
        assert!(err.contains("rank 1 waits in F(micro 0, chunk 0)"), "{err}");
        // A compute whose receive was never posted is refused.
        let mut unposted = bad.clone();
        unposted.actions[1].remove(0);
        let err = simulate(&unposted, Costs::default()).unwrap_err().to_string();
        assert!(err.contains("rank 1 runs F(micro 0, chunk 0) before its receive"), "{err}");
    }

    /// Two stages, one micro-batch, hand-computed: F on rank 0, the hop, F and B on rank 1, the
    /// hop back, B on rank 0.
    #[test]
    fn hops_and_per_rank_costs_lengthen_the_step() {
        let s = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let unit = Costs { forward: 1.0, input_grad: 1.0, weight_grad: 0.0, hop: 0.0 };
        let hop = simulate(&s, Costs { hop: 0.5, ..unit }).unwrap();
        assert_eq!(hop.makespan, 5.0);
        assert!((hop.bubble - (1.0 - 4.0 / 10.0)).abs() < 1e-12, "{hop}");
        let slow = simulate_ranks(&s, &[unit, Costs { forward: 2.0, ..unit }]).unwrap();
        assert_eq!(slow.makespan, 5.0);
        assert!((slow.bubble - 0.5).abs() < 1e-12, "{slow}");
        let err = simulate_ranks(&s, &[unit]).unwrap_err().to_string();
        assert!(err.contains("1 costs for pp=2 ranks"), "{err}");
    }

    #[test]
    fn a_missing_pass_is_reported() {
        let mut s = Schedule::new(ScheduleKind::GPipe, 1, 2, 1).unwrap();
        s.actions[0].pop();
        let err = simulate(&s, Costs::default()).unwrap_err().to_string();
        assert!(err.contains("backward of micro-batch 1, chunk 0 0 times"), "{err}");
    }
}
