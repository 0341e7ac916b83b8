//! Pipeline parallelism: a model given as an ordered list of layers is cut into stages
//! ([`split`], [`split_measured`]), each pipeline rank holds its stages ([`assign`]), and one
//! runtime ([`Pipeline`]) runs any schedule ([`Schedule`]: GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1), which is data: a per-rank list of actions. The same lists drive [`simulate()`],
//! which reports the bubble fraction and the micro-batches each rank holds; a measuring
//! pipeline ([`Pipeline::measure`]) reports what its steps spent time on ([`StepStats`]), whose
//! means feed the simulator ([`simulate_ranks`]).
//!
//! On a device mesh the pipeline runs over the mesh's `pp` group; data parallelism composes by
//! averaging gradients over the `dp` group after [`Pipeline::step`], and the global gradient
//! norm sums over `pp` ([`clip_grad_norm`]). The loss lives on the last stage; parameters held by
//! several stages are summed with [`Tied`].
mod p2p_order;
mod partition;
mod runtime;
mod schedule;
mod simulate;
mod stage;
mod stats;
mod tied;

pub use p2p_order::check_p2p_order;
pub use partition::{assign, layer_times, split, split_costs, split_measured, Balance, Split};
pub use runtime::Pipeline;
pub use schedule::{Action, Schedule, ScheduleKind, Step};
pub use simulate::{bubble_table, simulate, simulate_ranks, textbook_bubble, Costs, Simulation};
pub use stage::{Chunk, FnLayer, Layer};
pub use stats::{StepStats, Timed};
pub use tied::{clip_grad_norm, sum_tied_gradients, Tied};
