//! Cutting an ordered list of layers into contiguous stages: by layer count, by parameter
//! bytes, or by a measured per-layer cost (one timed forward and backward of each layer). The
//! split minimises the most expensive stage, which bounds the pipeline's step time; [`assign`]
//! then hands each rank its stages' layers.
use std::fmt;
use std::ops::Range;
use std::time::Instant;

use tch::{Kind, Tensor};

use super::stage::{Chunk, Layer};
use crate::error::ensure;
use crate::Result;

/// How to weigh layers when balancing stages; as a command-line value `layers`, `params` or
/// `time`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Balance {
    /// Every layer weighs the same.
    #[value(name = "layers")]
    Count,
    /// A layer weighs its parameters' bytes (balances memory).
    #[value(name = "params")]
    ParameterBytes,
    /// A layer weighs its measured forward and backward time on a sample: [`split_measured`].
    Time,
}

/// A split of layers into stages, with the cost it balanced.
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    /// `ranges[s]`: the layers of (virtual) stage `s`.
    pub ranges: Vec<Range<usize>>,
    /// The cost of each layer that was balanced.
    pub costs: Vec<f64>,
    /// What the cost is, for printing ("layers", "bytes", "seconds").
    pub unit: &'static str,
}

impl Split {
    /// The summed cost of each stage.
    pub fn stage_costs(&self) -> Vec<f64> {
        self.ranges.iter().map(|r| self.costs[r.clone()].iter().sum()).collect()
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let costs = self.stage_costs();
        let total: f64 = costs.iter().sum();
        for (s, (r, c)) in self.ranges.iter().zip(&costs).enumerate() {
            let share = if total > 0.0 { 100.0 * c / total } else { 0.0 };
            let cost = match self.unit {
                "seconds" => format!("{:.3} ms", c * 1e3),
                unit => format!("{c} {unit}"),
            };
            writeln!(f, "stage {s}: layers {}..{} ({cost}, {share:.1}% of the total)", r.start, r.end)?;
        }
        Ok(())
    }
}

/// Splits `layers` into `stages` contiguous non-empty ranges by `balance` (by count or bytes;
/// [`Balance::Time`] needs a sample: [`split_measured`]).
pub fn split(layers: &[Box<dyn Layer>], stages: usize, balance: Balance) -> Result<Split> {
    let (costs, unit) = match balance {
        Balance::Count => (vec![1.0; layers.len()], "layers"),
        Balance::ParameterBytes => (
            layers
                .iter()
                .map(|l| {
                    l.params().iter().map(|p| (p.tensor.numel() * p.tensor.kind().elt_size_in_bytes()) as f64).sum()
                })
                .collect(),
            "bytes",
        ),
        Balance::Time => {
            let why = "pipeline: balancing by time measures the layers on a sample: use split_measured";
            return Err(crate::Error::invalid(why));
        }
    };
    split_costs(costs, stages, unit)
}

/// Times of each layer's forward and backward taken for [`split_measured`]: the median of
/// this many runs, so one run disturbed by the rest of the machine does not move the split.
const TIMED_RUNS: usize = 5;

/// Times forward and backward of each layer (the median of `TIMED_RUNS` runs after `warmup`
/// untimed ones), feeding each layer the previous layer's output starting from `sample`, and
/// splits by those times. The measurement runs on `sample`'s device; it leaves no gradients
/// behind.
pub fn split_measured(layers: &[Box<dyn Layer>], stages: usize, sample: &Tensor, warmup: usize) -> Result<Split> {
    split_costs(layer_times(layers, sample, warmup)?, stages, "seconds")
}

/// Seconds of each layer's forward and backward (the median of `TIMED_RUNS` runs after
/// `warmup` untimed ones), each layer fed the previous layer's output starting from `sample`,
/// on `sample`'s device; no gradients are left behind.
pub fn layer_times(layers: &[Box<dyn Layer>], sample: &Tensor, warmup: usize) -> Result<Vec<f64>> {
    let mut costs = Vec::with_capacity(layers.len());
    let mut x = sample.f_detach()?;
    for (i, layer) in layers.iter().enumerate() {
        let mut times = Vec::with_capacity(TIMED_RUNS);
        let mut next = None;
        for run in 0..warmup + TIMED_RUNS {
            let input = x.f_detach()?.set_requires_grad(x.is_floating_point());
            let start = Instant::now();
            let out = layer.forward(&input)?;
            let total = out.f_sum(Kind::Float)?;
            if total.requires_grad() {
                crate::autograd::backward(&[&total], &[None], false)?;
            }
            // A scalar read waits for the device, so the time covers the work.
            let _ = total.f_double_value(&[])?;
            if run >= warmup {
                times.push(start.elapsed().as_secs_f64());
            }
            next = Some(out);
        }
        if let Some(out) = next {
            x = out.f_detach()?;
        }
        for p in layer.params() {
            crate::autograd::set_grad(&p.tensor, None)?;
        }
        times.sort_by(f64::total_cmp);
        let seconds = times[times.len() / 2];
        ensure!(seconds.is_finite(), "pipeline: timing layer {i} gave {seconds}");
        costs.push(seconds);
    }
    Ok(costs)
}

/// Splits weights `costs` into `stages` contiguous non-empty ranges minimising the largest
/// sum (dynamic programming over prefix sums; ties go to the earliest cut).
pub fn split_costs(costs: Vec<f64>, stages: usize, unit: &'static str) -> Result<Split> {
    let n = costs.len();
    ensure!(stages >= 1, "pipeline: cannot split into {stages} stages");
    ensure!(n >= stages, "pipeline: {n} layers cannot fill {stages} stages (each stage needs a layer)");
    ensure!(costs.iter().all(|c| c.is_finite() && *c >= 0.0), "pipeline: layer costs must be finite and >= 0");
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |acc, c| {
            *acc += c;
            Some(*acc)
        }))
        .collect();
    // best[k][i]: the smallest max-stage cost of the first i layers in k stages; cut[k][i]
    // where the last of those stages starts.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                let value = best[k - 1][j].max(prefix[i] - prefix[j]);
                if value < best[k][i] {
                    best[k][i] = value;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(stages);
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = cut[k][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    Ok(Split { ranges, costs, unit })
}

/// Takes the chunks of `layers` that pipeline rank `rank` of `pp` holds under `split` (one range
/// per virtual stage, `pp * v` of them): virtual stage `c * pp + rank` becomes chunk `c`. Every
/// rank may build the whole model and keep its part; the other layers are dropped.
pub fn assign(layers: Vec<Box<dyn Layer>>, split: &Split, rank: usize, pp: usize) -> Result<Vec<Chunk>> {
    let stages = split.ranges.len();
    ensure!(pp >= 1 && rank < pp, "pipeline: rank {rank} is not among pp={pp} ranks");
    ensure!(stages.is_multiple_of(pp), "pipeline: {stages} stages do not divide among pp={pp} ranks");
    ensure!(
        split.ranges.last().map(|r| r.end) == Some(layers.len()),
        "pipeline: the split covers {} layers but the model has {}",
        split.ranges.last().map_or(0, |r| r.end),
        layers.len()
    );
    let mut chunks: Vec<Chunk> = (rank..stages).step_by(pp).map(|stage| Chunk { stage, layers: Vec::new() }).collect();
    for (i, layer) in layers.into_iter().enumerate() {
        let stage = split
            .ranges
            .iter()
            .position(|r| r.contains(&i))
            .ok_or_else(|| crate::Error::invalid(format!("pipeline: the split leaves out layer {i}")))?;
        if stage % pp == rank {
            chunks[stage / pp].layers.push(layer);
        }
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balances_the_largest_stage() {
        let s = split_costs(vec![1.0; 8], 4, "layers").unwrap();
        assert_eq!(s.ranges, vec![0..2, 2..4, 4..6, 6..8]);
        // One heavy layer gets a stage to itself.
        let s = split_costs(vec![1.0, 1.0, 6.0, 1.0, 1.0, 1.0], 3, "s").unwrap();
        assert_eq!(s.ranges, vec![0..2, 2..3, 3..6]);
        assert_eq!(s.stage_costs(), vec![2.0, 6.0, 3.0]);
        assert!(s.to_string().contains("stage 1: layers 2..3 (6 s, 54.5% of the total)"), "{s}");
    }

    #[test]
    fn measured_costs_split_every_layer_and_leave_no_gradients() {
        use super::super::stage::FnLayer;
        use crate::optim::Param;
        let layers: Vec<Box<dyn Layer>> = (0..4)
            .map(|i| {
                let w = Tensor::randn([8, 8], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
                // Layer 2 repeats its matmul: the heavy one.
                let repeats = if i == 2 { 20 } else { 1 };
                Box::new(FnLayer::new(vec![Param::new(format!("w{i}"), &w)], move |x: &Tensor, p: &[Param]| {
                    let mut y = x.shallow_clone();
                    for _ in 0..repeats {
                        y = y.f_matmul(&p[0].tensor)?.f_tanh()?;
                    }
                    Ok(y)
                })) as Box<dyn Layer>
            })
            .collect();
        let sample = Tensor::randn([16, 8], (Kind::Float, tch::Device::Cpu));
        let s = split_measured(&layers, 2, &sample, 1).unwrap();
        assert_eq!(s.ranges.len(), 2);
        assert_eq!((s.ranges[0].start, s.ranges[1].end), (0, 4));
        assert!(s.costs.iter().all(|&c| c > 0.0), "{:?}", s.costs);
        assert!(s.to_string().contains(" ms, "), "{s}");
        assert!(layers.iter().flat_map(|l| l.params()).all(|p| !p.tensor.grad().defined()));
        let bytes = split(&layers, 4, Balance::ParameterBytes).unwrap();
        assert_eq!(bytes.costs, vec![256.0; 4]);
    }

    #[test]
    fn too_few_layers_is_an_error() {
        let err = split_costs(vec![1.0; 3], 4, "layers").unwrap_err().to_string();
        assert!(err.contains("3 layers cannot fill 4 stages"), "{err}");
    }
}
