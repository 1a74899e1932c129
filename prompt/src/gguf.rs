//! The GGUF container: header, metadata key-values and the tensor directory, read over a
//! memory map. Tensor data is located and bounds-checked here but never decoded; the engine
//! turns it into weights.

mod reader;
mod types;

pub use reader::{GgufFile, GgufTensorInfo};
pub use types::{GgmlType, GgufValue};
