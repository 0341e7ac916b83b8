//! Vision Transformer pretraining: the model, batch arithmetic, data sets and transforms, the
//! training loop with its tensor- and pipeline-parallel layouts, checkpoints and metrics, evaluation, and the benchmark.
pub mod batch;
pub mod bench;
pub mod checkpoint;
pub mod datasets;
pub mod eval;
pub mod metrics;
pub mod model;
pub mod model_file;
pub mod multi_dim;
pub mod pipeline_parallel;
pub mod plan;
pub mod profile;
pub mod sequence_parallel;
pub mod tensor_parallel;
pub mod train;
