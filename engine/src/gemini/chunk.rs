//! Chunks: contiguous buffers of one dtype holding several parameters, each parameter a view
//! at its offset, so moving or gathering a chunk moves all its parameters with one copy
//! (Colossal-AI's Gemini, after PatrickStar). This file has the layout (which parameter goes
//! where, and the chunk size that wastes least) and the per-tensor state machine.
use std::fmt;

use crate::{Error, Result};

/// Where a tensor of a chunk is in the training step. The legal moves are those of
/// [`TensorState::can_move_to`]; anything else is a bug in the caller and is refused with the
/// tensor's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorState {
    /// The chunk's full payload is not in memory (only its home copy or shard is).
    Free,
    /// In memory and not in use.
    Hold,
    /// In use by a module's forward or backward.
    Compute,
    /// Its module's backward is done but its gradient has not arrived yet.
    HoldAfterBackward,
    /// Its gradient has arrived; the chunk's gradient is reduced once every tensor is here.
    ReadyForReduce,
}

impl TensorState {
    /// Whether `self -> to` is a legal move:
    ///
    /// | from | to | when |
    /// |---|---|---|
    /// | Free | Hold | the chunk is gathered or loaded |
    /// | Hold | Free | the chunk is released |
    /// | Hold | Compute | a module that uses it starts forward or backward |
    /// | Compute | Hold | that module's forward is done |
    /// | Compute | HoldAfterBackward | that module's backward is done, gradient not yet here |
    /// | Compute, HoldAfterBackward | ReadyForReduce | its gradient arrived |
    /// | ReadyForReduce | Hold | the chunk's gradient was reduced |
    /// | HoldAfterBackward | Hold | the step ended without a gradient for it |
    /// | HoldAfterBackward | Compute | another module using it starts its backward |
    pub fn can_move_to(self, to: TensorState) -> bool {
        use TensorState::*;
        matches!(
            (self, to),
            (Free, Hold)
                | (Hold, Free)
                | (Hold, Compute)
                | (Compute, Hold)
                | (Compute, HoldAfterBackward)
                | (Compute, ReadyForReduce)
                | (HoldAfterBackward, ReadyForReduce)
                | (ReadyForReduce, Hold)
                | (HoldAfterBackward, Hold)
                | (HoldAfterBackward, Compute)
        )
    }
}

impl fmt::Display for TensorState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One parameter's place in a chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// First element in the chunk.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
    /// Where it is in the step.
    pub state: TensorState,
}

impl Slot {
    /// Moves to `to`, or errors naming the tensor and both states.
    pub fn move_to(&mut self, to: TensorState) -> Result<()> {
        if !self.state.can_move_to(to) {
            return Err(Error::invalid(format!(
                "gemini: illegal state change of {}: {} -> {to} (a bug in the caller, not in the data)",
                self.name, self.state
            )));
        }
        self.state = to;
        Ok(())
    }
}

/// Parameters in execution order, packed into chunks.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    /// Elements per chunk (every chunk has this capacity, a multiple of the rank count).
    pub chunk_size: usize,
    /// Each chunk's parameter indices, in order.
    pub chunks: Vec<Vec<usize>>,
}

impl Layout {
    /// Packs parameters of `numels` elements, in order, into chunks of `chunk_size` elements
    /// (a parameter never straddles two chunks; `chunk_size` must hold the largest).
    pub fn pack(numels: &[usize], chunk_size: usize) -> Layout {
        let mut chunks: Vec<Vec<usize>> = vec![];
        let mut used = chunk_size; // forces a first chunk
        for (i, &n) in numels.iter().enumerate() {
            if used + n > chunk_size {
                chunks.push(vec![]);
                used = 0;
            }
            chunks.last_mut().expect("pushed above").push(i);
            used += n;
        }
        Layout { chunk_size, chunks }
    }

    /// Elements allocated but holding no parameter.
    pub fn wasted(&self, numels: &[usize]) -> usize {
        self.chunks.iter().map(|c| self.chunk_size - c.iter().map(|&i| numels[i]).sum::<usize>()).sum()
    }

    /// The chunk size in `[min, max]` (stepping by `step`, rounded up to a multiple of
    /// `ranks`, and never below the largest parameter) that wastes the fewest elements, the
    /// smallest on ties (Colossal-AI's `search_chunk_configuration`). A model smaller than
    /// `min` gets one chunk of its own size.
    pub fn search(numels: &[usize], min: usize, max: usize, step: usize, ranks: usize) -> Layout {
        let round = |n: usize| n.div_ceil(ranks.max(1)) * ranks.max(1);
        let total: usize = numels.iter().sum();
        if total <= min {
            return Layout::pack(numels, round(total.max(1)));
        }
        let largest = numels.iter().copied().max().unwrap_or(1);
        let first = round(min.max(largest));
        let mut best = Layout::pack(numels, first);
        let mut best_waste = best.wasted(numels);
        let mut size = first;
        while size < max {
            size = round(size + step.max(1));
            let layout = Layout::pack(numels, size);
            let waste = layout.wasted(numels);
            if waste < best_waste {
                (best, best_waste) = (layout, waste);
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TensorState::*;

    #[test]
    fn legal_and_illegal_moves() {
        let mut s = Slot { name: "blocks.0.w".into(), shape: vec![2], offset: 0, numel: 2, state: Free };
        for to in [Hold, Compute, Hold, Compute, HoldAfterBackward, ReadyForReduce, Hold, Free] {
            s.move_to(to).unwrap();
        }
        let err = s.move_to(Compute).unwrap_err().to_string();
        assert!(err.contains("illegal state change of blocks.0.w: Free -> Compute"), "{err}");
        assert_eq!(s.state, Free, "a refused move changes nothing");
        assert!(!ReadyForReduce.can_move_to(Free) && !Compute.can_move_to(Free));
    }

    #[test]
    fn packing_keeps_order_and_never_splits_a_parameter() {
        let numels = [4, 4, 3, 6, 1];
        let l = Layout::pack(&numels, 8);
        assert_eq!(l.chunks, vec![vec![0, 1], vec![2], vec![3, 4]]);
        assert_eq!(l.wasted(&numels), 6, "0 + 5 + 1");
    }

    #[test]
    fn search_minimises_waste_and_respects_ranks() {
        let numels = [4, 4, 3, 6, 1];
        // 9 holds [4,4], [3,6], [1] (waste 1 + 0 + 8 = 9); 11 holds [4,4,3], [6,1] (0 + 4);
        // 18 holds everything (0): the search picks 18.
        let l = Layout::search(&numels, 8, 18, 1, 1);
        assert_eq!((l.chunk_size, l.wasted(&numels)), (18, 0));
        // With 4 ranks sizes are multiples of 4: 8, 12, 16, 20 -> 20 holds all (waste 2) ...
        let l = Layout::search(&numels, 8, 20, 1, 4);
        assert_eq!(l.chunk_size % 4, 0);
        assert_eq!(
            l.wasted(&numels),
            [8, 12, 16, 20].iter().map(|&s| Layout::pack(&numels, s).wasted(&numels)).min().unwrap()
        );
        // A tiny model is one chunk.
        let l = Layout::search(&[3, 2], 100, 1000, 10, 2);
        assert_eq!((l.chunk_size, l.chunks.len()), (6, 1));
        // The largest parameter always fits.
        assert_eq!(Layout::search(&[50, 1, 1], 8, 16, 4, 1).chunk_size, 50);
    }
}
