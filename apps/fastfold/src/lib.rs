//! `fastfold`: AlphaFold 2 structure prediction with dynamic axial parallelism (DAP).
pub mod confidence;
pub mod geometry;
pub mod model;
