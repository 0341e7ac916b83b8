//! Vision Transformer pretraining: the model, batch arithmetic, data sets and transforms, the
//! job's parallel layout and its application to the serial model (tensor, sequence and
//! pipeline parallelism), the training loop, checkpoints and metrics, evaluation, the planner's
//! glue and the benchmark.
pub mod args;
pub mod batch;
pub mod bench;
pub mod checkpoint;
pub mod datasets;
pub mod eval;
pub mod layout;
pub mod mesh;
pub mod metrics;
pub mod model;
pub mod model_file;
pub mod multi_dim;
pub mod parallelize;
pub mod pipeline_parallel;
pub mod placement;
pub mod plan;
pub mod profile;
pub mod sequence_parallel;
pub mod tensor_parallel;
pub mod train;
