//! A model's text metadata, read without its weights: the tokenizer (vocabulary, special
//! ids, chat template), the context length and the fingerprint, from a `.gguf` file or an
//! HF checkpoint (config.json, tokenizer.json, tokenizer_config.json or
//! chat_template.jinja, and the safetensors shards, which only the fingerprint reads).

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};

use kvmesh_common::{ModelFingerprint, TokenId};
use serde::Deserialize;

use crate::error::ModelFileError;
use crate::fingerprint::{fingerprint, Part};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

/// Where a model's files are, by format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelFiles {
    /// One file: weights, tokenizer and template in its metadata.
    Gguf(PathBuf),
    /// An HF checkpoint: the JSON files in `dir` and the weights in `shards`.
    Hf { dir: PathBuf, shards: Vec<PathBuf> },
}

impl ModelFiles {
    /// A `.gguf` file, a `.safetensors` file (its directory holds the rest), or a
    /// checkpoint directory (the shards model.safetensors.index.json names, else every
    /// `*.safetensors` file in it).
    pub fn locate(path: &Path) -> Result<Self, ModelFileError> {
        if path.is_dir() {
            return Ok(ModelFiles::Hf {
                dir: path.to_path_buf(),
                shards: shard_files(path)?,
            });
        }
        let mut magic = Vec::with_capacity(4);
        File::open(path)
            .and_then(|f| f.take(4).read_to_end(&mut magic))
            .map_err(|source| io_error(path, source))?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if magic == b"GGUF" || ext.eq_ignore_ascii_case("gguf") {
            Ok(ModelFiles::Gguf(path.to_path_buf()))
        } else if ext.eq_ignore_ascii_case("safetensors") {
            Ok(ModelFiles::Hf {
                dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                shards: vec![path.to_path_buf()],
            })
        } else {
            Err(ModelFileError::UnknownFormat {
                path: path.to_path_buf(),
            })
        }
    }
}

/// What the text path needs of a model.
#[derive(Debug)]
pub struct ModelText {
    pub tokenizer: Tokenizer,
    /// The longest sequence (prompt and completion) the model was trained for.
    pub max_context: usize,
    /// Identity of the weights and tokenizer: the root of every prefix-hash chain.
    pub fingerprint: ModelFingerprint,
}

impl ModelText {
    /// Reads the model at `path` (see [`ModelFiles::locate`]).
    pub fn read(path: &Path) -> Result<Self, ModelFileError> {
        match ModelFiles::locate(path)? {
            ModelFiles::Gguf(file) => Self::from_gguf(&GgufFile::open(&file)?),
            ModelFiles::Hf { dir, shards } => Self::from_hf(&dir, &shards),
        }
    }

    /// From the metadata of an opened GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelFileError> {
        let max_context = gguf_context_length(g)?;
        let tokenizer = Tokenizer::from_gguf(g)?;
        // The whole file: two fine-tunes can share a header and tensor table.
        let fingerprint = fingerprint(&[Part::File(&g.path)])?;
        Ok(ModelText {
            tokenizer,
            max_context,
            fingerprint,
        })
    }

    /// From an HF checkpoint directory and its weight shards.
    pub fn from_hf(dir: &Path, shards: &[PathBuf]) -> Result<Self, ModelFileError> {
        let config_path = dir.join("config.json");
        let config_bytes = read(&config_path)?;
        let config: HfTextConfig =
            serde_json::from_slice(&config_bytes).map_err(|source| ModelFileError::Json {
                path: config_path.clone(),
                source,
            })?;
        if config.max_position_embeddings == 0 {
            return Err(ModelFileError::BadConfigValue {
                path: config_path,
                key: "max_position_embeddings".into(),
                reason: "must be positive".into(),
            });
        }
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer_bytes = read(&tokenizer_path)?;
        let chat_template = chat_template(dir)?;
        let tokenizer = Tokenizer::from_hf_json(
            &tokenizer_bytes,
            config.bos_token_id(),
            config.eos_token_id(),
            chat_template.clone(),
        )
        .map_err(|source| ModelFileError::Tokenizer {
            path: tokenizer_path,
            source,
        })?;
        let template_bytes = chat_template.unwrap_or_default();
        let mut parts = vec![
            Part::Bytes(&config_bytes),
            Part::Bytes(&tokenizer_bytes),
            Part::Bytes(template_bytes.as_bytes()),
        ];
        parts.extend(shards.iter().map(|s| Part::File(s)));
        Ok(ModelText {
            tokenizer,
            max_context: config.max_position_embeddings,
            fingerprint: fingerprint(&parts)?,
        })
    }
}

/// `{arch}.context_length`, the GGUF name of the model's context length.
pub fn gguf_context_length(g: &GgufFile) -> Result<usize, ModelFileError> {
    let arch = g.str_req("general.architecture")?;
    g.positive_req(&format!("{arch}.context_length"))
}

/// The fields of an HF config.json that the text path reads.
#[derive(Clone, Debug, Deserialize)]
pub struct HfTextConfig {
    pub max_position_embeddings: usize,
    bos_token_id: Option<OneOrMany>,
    eos_token_id: Option<OneOrMany>,
}

impl HfTextConfig {
    pub fn bos_token_id(&self) -> Option<TokenId> {
        self.bos_token_id.as_ref().and_then(OneOrMany::first)
    }

    /// The primary EOS id (config.json may list several, as Llama 3.1 does).
    pub fn eos_token_id(&self) -> Option<TokenId> {
        self.eos_token_id.as_ref().and_then(OneOrMany::first)
    }
}

/// `eos_token_id` may be a list (Llama 3.1); the first is the primary one.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(TokenId),
    Many(Vec<TokenId>),
}

impl OneOrMany {
    fn first(&self) -> Option<TokenId> {
        match self {
            OneOrMany::One(id) => Some(*id),
            OneOrMany::Many(ids) => ids.first().copied(),
        }
    }
}

fn io_error(path: &Path, source: std::io::Error) -> ModelFileError {
    ModelFileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ModelFileError> {
    fs::read(path).map_err(|source| io_error(path, source))
}

/// The shards named by model.safetensors.index.json, else every `*.safetensors` file.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, ModelFileError> {
    let index = dir.join("model.safetensors.index.json");
    let mut files: Vec<PathBuf> = if index.exists() {
        #[derive(Deserialize)]
        struct Index {
            weight_map: std::collections::BTreeMap<String, String>,
        }
        let parsed: Index =
            serde_json::from_slice(&read(&index)?).map_err(|source| ModelFileError::Json {
                path: index.clone(),
                source,
            })?;
        let mut names: Vec<String> = parsed.weight_map.into_values().collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        let entries = fs::read_dir(dir).map_err(|source| io_error(dir, source))?;
        entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect()
    };
    files.sort();
    if files.is_empty() {
        return Err(ModelFileError::UnknownFormat {
            path: dir.to_path_buf(),
        });
    }
    Ok(files)
}

/// tokenizer_config.json's `chat_template` (a string, or a list of named templates of
/// which "default" is used), else a chat_template.jinja file.
fn chat_template(dir: &Path) -> Result<Option<String>, ModelFileError> {
    let config_path = dir.join("tokenizer_config.json");
    if config_path.exists() {
        let value: serde_json::Value =
            serde_json::from_slice(&read(&config_path)?).map_err(|source| {
                ModelFileError::Json {
                    path: config_path.clone(),
                    source,
                }
            })?;
        match value.get("chat_template") {
            Some(serde_json::Value::String(t)) => return Ok(Some(t.clone())),
            Some(serde_json::Value::Array(named)) => {
                let default = named.iter().find(|t| t["name"] == "default");
                if let Some(t) = default.and_then(|t| t["template"].as_str()) {
                    return Ok(Some(t.into()));
                }
            }
            _ => {}
        }
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        let text = fs::read_to_string(&jinja).map_err(|source| io_error(&jinja, source))?;
        return Ok(Some(text));
    }
    Ok(None)
}
