//! The text path: a model's text metadata read without its weights ([`ModelText`]: the
//! tokenizer, special ids, chat template, context length and fingerprint, from GGUF or an
//! HF checkpoint), the GGUF container reader, the tokenizer, the chat template, incremental
//! detokenization and stop conditions, and locating (or fetching) the default model. The
//! router needs only this; the engine builds the weights on top of it.

pub mod chat_template;
pub mod detokenizer;
pub mod error;
pub mod fingerprint;
pub mod gguf;
pub mod grammar;
pub mod model_fetch;
pub mod model_text;
pub mod stop;
pub mod tokenizer;

pub use error::ModelFileError;
pub use model_text::{ModelFiles, ModelText};
