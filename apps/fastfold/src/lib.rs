//! FastFold: AlphaFold-style protein structure prediction and training with Dynamic Axial
//! Parallelism.
pub mod confidence;
pub mod geometry;
