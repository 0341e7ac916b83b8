//! The `vit` application: Vision Transformer models (timm-compatible names) and, as they land,
//! large-batch pretraining, evaluation and benchmarking.
pub mod model;
