//! How a forward runs, apart from its weights and inputs: the DAP group the stacks split over
//! and the chunk size of the memory-heavy steps. The stacks and modules take one `&Exec`, so
//! the command line's choices reach every operation through one value rather than two
//! parameters threaded by hand through each layer.
//!
//! Each module that is an operation of its own (row and column attention, the transitions, the
//! outer product mean, the triangle updates and attentions, the template pair stack and
//! pointwise attention) reads its chunk size with [`Exec::chunk`] and hands the number to the
//! primitives it shares with the others ([`crate::model::layers::chunked`],
//! [`crate::model::attention::Attention::forward`]). A chunk size chosen per operation (a
//! memory planner fitting each step to a budget) then changes what `chunk` is asked, at the
//! places that call it, and no signature in between.
use engine::parallel::dap::Dap;

/// The DAP context and chunk size a forward runs under.
#[derive(Clone, Debug)]
pub struct Exec {
    dap: Dap,
    chunk: Option<i64>,
}

impl Exec {
    /// One process, nothing chunked: the reference the chunked and DAP runs are checked against.
    pub fn serial() -> Exec {
        Exec::new(Dap::none(), None)
    }

    /// DAP over `dap`'s group, the memory-heavy steps `chunk` rows at a time (`None`: whole).
    pub fn new(dap: Dap, chunk: Option<i64>) -> Exec {
        Exec { dap, chunk }
    }

    /// The DAP context (with no group, every layout switch is the identity).
    pub fn dap(&self) -> &Dap {
        &self.dap
    }

    /// How many rows of its batch-like axis a memory-heavy step takes at a time (`None`: all).
    /// Every chunked operation reads its size here, so that one place decides it.
    pub fn chunk(&self) -> Option<i64> {
        self.chunk
    }

    /// This context without the DAP group, for the modules every rank runs whole (the
    /// templates): they chunk as the caller chose, on this rank alone.
    pub fn without_dap(&self) -> Exec {
        Exec { dap: Dap::none(), chunk: self.chunk }
    }
}
