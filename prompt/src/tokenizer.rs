//! Text <-> token ids for byte-level BPE models (GPT-2 style: SmolLM, Llama 3, Qwen2).
//!
//! Built on the `tokenizers` crate. A GGUF's `tokenizer.ggml.*` metadata is turned into
//! the same pipeline llama.cpp runs (its pre-tokenizer regexes, then byte-level BPE), so ids
//! match llama.cpp; a safetensors checkpoint brings its own tokenizer.json.
//! Decoding goes through a per-token byte table, which the incremental detokenizer shares,
//! so streamed text always equals the text of the whole sequence.

use std::collections::HashSet;
use std::sync::LazyLock;

use kvmesh_common::TokenId;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::ModelFileError;
use crate::gguf::GgufFile;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("unsupported tokenizer model `{0}` (supported: gpt2, i.e. byte-level BPE)")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer `{0}` (supported: smollm, starcoder, gpt2, llama3, qwen2 and their aliases)")]
    UnsupportedPreTokenizer(String),
    #[error("only byte-level BPE tokenizers are supported; this tokenizer's decoder is {0}")]
    UnsupportedDecoder(String),
    #[error("merge #{index} {merge:?} is not two tokens separated by a space")]
    BadMerge { index: usize, merge: String },
    #[error("`{key}` has {len} entries for {tokens} tokens")]
    LengthMismatch {
        key: &'static str,
        len: usize,
        tokens: usize,
    },
    #[error("`{key}` = {id} is outside the vocabulary of {vocab} tokens")]
    IdOutOfRange {
        key: &'static str,
        id: u64,
        vocab: usize,
    },
    #[error("{context}: {message}")]
    Library {
        context: &'static str,
        message: String,
    },
}

fn library(context: &'static str) -> impl Fn(tokenizers::Error) -> TokenizerError {
    move |e| TokenizerError::Library {
        context,
        message: e.to_string(),
    }
}

/// llama.cpp's GPT-2 split (llama-vocab.cpp); HF's ByteLevel adds a final `|\s+`, which
/// only changes how a lone whitespace run is grouped, never the resulting pieces.
const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The regexes llama.cpp applies, in order, for a `tokenizer.ggml.pre` name, and whether
/// it skips merges for words that are whole tokens (Llama 3).
fn pre_tokenizer_regexes(pre: &str) -> Option<(Vec<&'static str>, bool)> {
    Some(match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            (vec![r"\p{N}", GPT2_RE], false)
        }
        "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" => (vec![GPT2_RE], false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => (vec![LLAMA3_RE], true),
        "dbrx" | "smaug-bpe" => (vec![LLAMA3_RE], false),
        "qwen2" | "stablelm2" | "deepseek-r1-qwen" => (vec![QWEN2_RE], false),
        "default" => (
            vec![
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_RE,
                r"\p{N}+",
                "[0-9][0-9][0-9]",
            ],
            false,
        ),
        _ => return None,
    })
}

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A byte-level BPE tokenizer plus the model's special ids and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    /// Splits special tokens written in the text out as their ids.
    hf: tokenizers::Tokenizer,
    /// Treats the text of special tokens as plain text.
    hf_literal: tokenizers::Tokenizer,
    bos: Option<TokenId>,
    eos: Option<TokenId>,
    chat_template: Option<String>,
    /// Bytes of token `i` are `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    special: Vec<bool>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// From the `tokenizer.ggml.*` and `tokenizer.chat_template` metadata of a GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelFileError> {
        let err = |source| ModelFileError::Tokenizer {
            path: g.path.clone(),
            source,
        };
        let model = g.str_req("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(err(TokenizerError::UnsupportedModel(model.into())));
        }
        let tokens = string_array(g, "tokenizer.ggml.tokens")?;
        let merges = string_array(g, "tokenizer.ggml.merges")?;
        let types = match g.array_opt("tokenizer.ggml.token_type")? {
            Some(a) => a
                .iter()
                .map(|v| {
                    v.as_i64().ok_or_else(|| ModelFileError::WrongMetadataType {
                        path: g.path.clone(),
                        key: "tokenizer.ggml.token_type".into(),
                        expected: "an array of integers",
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(err(TokenizerError::LengthMismatch {
                key: "tokenizer.ggml.token_type",
                len: types.len(),
                tokens: tokens.len(),
            }));
        }
        let pre = g.str_opt("tokenizer.ggml.pre")?.unwrap_or("default");
        let id = |key: &'static str| -> Result<Option<TokenId>, ModelFileError> {
            match g.u64_opt(key)? {
                Some(id) if (id as usize) < tokens.len() => Ok(Some(id as TokenId)),
                Some(id) => Err(err(TokenizerError::IdOutOfRange {
                    key,
                    id,
                    vocab: tokens.len(),
                })),
                None => Ok(None),
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let add_bos = g.bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let add_eos = g.bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let chat_template = g.str_opt("tokenizer.chat_template")?.map(String::from);

        let hf = gguf_pipeline(
            &tokens,
            &merges,
            &types,
            pre,
            bos.filter(|_| add_bos),
            eos.filter(|_| add_eos),
        )
        .map_err(err)?;
        let special = types.iter().map(|&t| t == TOKEN_TYPE_CONTROL).collect();
        Ok(Self::assemble(
            hf,
            tokens
                .iter()
                .copied()
                .enumerate()
                .map(|(i, t)| (i as TokenId, t)),
            special,
            bos,
            eos,
            chat_template,
        ))
    }

    /// From a HF `tokenizer.json`; `bos`/`eos` and the chat template come from the
    /// checkpoint's config.json and tokenizer_config.json.
    pub fn from_hf_json(
        json: &[u8],
        bos: Option<TokenId>,
        eos: Option<TokenId>,
        chat_template: Option<String>,
    ) -> Result<Self, TokenizerError> {
        let hf =
            tokenizers::Tokenizer::from_bytes(json).map_err(library("parsing tokenizer.json"))?;
        let decoder = serde_json::to_value(hf.get_decoder()).unwrap_or_default();
        if !is_byte_level(&decoder) {
            let kind = decoder
                .get("type")
                .and_then(|t| t.as_str())
                .unwrap_or("none");
            return Err(TokenizerError::UnsupportedDecoder(kind.into()));
        }
        let vocab = hf.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut special = vec![false; n];
        for (id, tok) in hf.get_added_tokens_decoder() {
            special[id as usize] = tok.special;
        }
        let entries: Vec<(TokenId, String)> = vocab.into_iter().map(|(t, id)| (id, t)).collect();
        for (key, id) in [("bos_token_id", bos), ("eos_token_id", eos)] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::IdOutOfRange {
                    key,
                    id: id.into(),
                    vocab: n,
                });
            }
        }
        Ok(Self::assemble(
            hf,
            entries.iter().map(|(id, t)| (*id, t.as_str())),
            special,
            bos,
            eos,
            chat_template,
        ))
    }

    fn assemble<'a>(
        hf: tokenizers::Tokenizer,
        entries: impl Iterator<Item = (TokenId, &'a str)>,
        special: Vec<bool>,
        bos: Option<TokenId>,
        eos: Option<TokenId>,
        chat_template: Option<String>,
    ) -> Self {
        let n = special.len();
        let mut per_token: Vec<Vec<u8>> = vec![Vec::new(); n];
        for (id, text) in entries {
            if let Some(slot) = per_token.get_mut(id as usize) {
                *slot = byte_level_decode(text);
            }
        }
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        let mut bytes = Vec::new();
        for b in per_token {
            bytes.extend_from_slice(&b);
            offsets.push(bytes.len());
        }
        let mut hf_literal = hf.clone();
        hf_literal.set_encode_special_tokens(true);
        Tokenizer {
            hf,
            hf_literal,
            bos,
            eos,
            chat_template,
            bytes,
            offsets,
            special,
        }
    }

    /// Token ids of `text`. With `parse_special`, special tokens written in the text
    /// (e.g. `<|im_start|>`) become their ids; otherwise they are tokenized as plain text.
    /// BOS/EOS are added only where the model's metadata asks for it.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<TokenId>, TokenizerError> {
        let hf = if parse_special {
            &self.hf
        } else {
            &self.hf_literal
        };
        let enc = hf.encode_fast(text, true).map_err(library("encoding"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`; ids outside the vocabulary are ignored, invalid UTF-8 becomes
    /// U+FFFD.
    pub fn decode(&self, ids: &[TokenId], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if !(skip_special && self.is_special(id)) {
                bytes.extend_from_slice(self.token_bytes(id).unwrap_or_default());
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes token `id` stands for (a piece of a UTF-8 character for byte tokens).
    pub fn token_bytes(&self, id: TokenId) -> Option<&[u8]> {
        let i = id as usize;
        (i + 1 < self.offsets.len()).then(|| &self.bytes[self.offsets[i]..self.offsets[i + 1]])
    }

    /// The id of a token given its exact text (e.g. `"<|im_end|>"`).
    pub fn token_id(&self, token: &str) -> Option<TokenId> {
        self.hf.token_to_id(token)
    }

    pub fn bos_token_id(&self) -> Option<TokenId> {
        self.bos
    }

    pub fn eos_token_id(&self) -> Option<TokenId> {
        self.eos
    }

    /// Number of token ids (highest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.special.len()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Control tokens (`<|im_start|>`, `<|endoftext|>`, ...), which `skip_special` drops.
    pub fn is_special(&self, id: TokenId) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Ids of all special tokens, e.g. to stop on any of them.
    pub fn special_ids(&self) -> HashSet<TokenId> {
        (0..)
            .zip(&self.special)
            .filter(|(_, &s)| s)
            .map(|(i, _)| i)
            .collect()
    }
}

/// llama.cpp's pipeline for a GGUF `gpt2` vocabulary: the regexes of its pre-tokenizer
/// `pre`, then byte-level BPE; BOS/EOS (if given) wrap every encoding.
fn gguf_pipeline(
    tokens: &[&str],
    merges: &[&str],
    types: &[i64],
    pre: &str,
    bos: Option<TokenId>,
    eos: Option<TokenId>,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let (regexes, ignore_merges) = pre_tokenizer_regexes(pre)
        .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(pre.into()))?;
    let vocab: Vocab = (0..).zip(tokens).map(|(i, t)| (t.to_string(), i)).collect();
    let merges = parse_merges(merges)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(library("building the BPE model"))?;
    let mut hf = tokenizers::Tokenizer::new(bpe);
    let mut steps = Vec::with_capacity(regexes.len() + 1);
    for re in &regexes {
        let split = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(library("compiling a pre-tokenizer regex"))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    // Byte-level mapping only: the splitting was done above.
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));
    hf.with_pre_tokenizer(Some(Sequence::new(steps)));
    hf.with_decoder(Some(ByteLevel::default()));
    if let Some(post) = bos_eos_processor(tokens, bos, eos)? {
        hf.with_post_processor(Some(post));
    }
    // Control tokens are matched in text as specials (when parsing specials);
    // user-defined ones always, like llama.cpp.
    let added = |kind: i64, special: bool| -> Vec<AddedToken> {
        types
            .iter()
            .zip(tokens)
            .filter(|(&t, _)| t == kind)
            .map(|(_, tok)| AddedToken::from(tok.to_string(), special).normalized(false))
            .collect()
    };
    hf.add_special_tokens(&added(TOKEN_TYPE_CONTROL, true));
    hf.add_tokens(&added(TOKEN_TYPE_USER_DEFINED, false));
    Ok(hf)
}

/// A post-processor that wraps every encoding in BOS and/or EOS, as the GGUF asks.
fn bos_eos_processor(
    tokens: &[&str],
    bos: Option<TokenId>,
    eos: Option<TokenId>,
) -> Result<Option<TemplateProcessing>, TokenizerError> {
    if bos.is_none() && eos.is_none() {
        return Ok(None);
    }
    fn err(e: impl std::fmt::Display) -> TokenizerError {
        TokenizerError::Library {
            context: "building the BOS/EOS template",
            message: e.to_string(),
        }
    }
    let name = |id: TokenId| tokens[id as usize].to_string();
    let mut single: Vec<String> = bos.map(name).into_iter().collect();
    single.push("$A".into());
    single.extend(eos.map(name));
    let specials: Vec<(String, TokenId)> = bos
        .into_iter()
        .chain(eos)
        .map(|id| (name(id), id))
        .collect();
    TemplateProcessing::builder()
        .try_single(single)
        .map_err(err)?
        .special_tokens(specials)
        .build()
        .map(Some)
        .map_err(err)
}

fn string_array<'a>(g: &'a GgufFile, key: &str) -> Result<Vec<&'a str>, ModelFileError> {
    let wrong = || ModelFileError::WrongMetadataType {
        path: g.path.clone(),
        key: key.into(),
        expected: "an array of strings",
    };
    let arr = g
        .array_opt(key)?
        .ok_or_else(|| ModelFileError::MissingMetadata {
            path: g.path.clone(),
            key: key.into(),
        })?;
    arr.iter().map(|v| v.as_str().ok_or_else(wrong)).collect()
}

/// GGUF stores merges as "left right"; split at the first space after the first
/// character, as llama.cpp does.
fn parse_merges(merges: &[&str]) -> Result<Merges, TokenizerError> {
    merges
        .iter()
        .enumerate()
        .map(|(index, m)| {
            let at = m
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i);
            match at {
                Some(i) => Ok((m[..i].to_string(), m[i + 1..].to_string())),
                None => Err(TokenizerError::BadMerge {
                    index,
                    merge: m.to_string(),
                }),
            }
        })
        .collect()
}

fn is_byte_level(decoder: &serde_json::Value) -> bool {
    match decoder.get("type").and_then(|t| t.as_str()) {
        Some("ByteLevel") => true,
        Some("Sequence") => decoder
            .get("decoders")
            .and_then(|d| d.as_array())
            .is_some_and(|ds| ds.iter().any(is_byte_level)),
        _ => false,
    }
}

/// GPT-2's byte-to-printable-char table, inverted: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes were shifted to U+0100.. in byte order.
fn char_to_byte(c: char) -> Option<u8> {
    static SHIFTED: LazyLock<Vec<u8>> =
        LazyLock::new(|| (0..=255u8).filter(|&b| !printable(b)).collect());
    fn printable(b: u8) -> bool {
        matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff)
    }
    match u32::from(c) {
        c @ 0..=0xff => Some(c as u8).filter(|&b| printable(b)),
        c => SHIFTED.get(c as usize - 0x100).copied(),
    }
}

/// What HF's ByteLevel decoder makes of one token: mapped bytes if every char is in the
/// table, else the token's own UTF-8 (e.g. added tokens with newlines).
fn byte_level_decode(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_inverts_gpt2_mapping() {
        assert_eq!(char_to_byte('Ġ'), Some(b' '));
        assert_eq!(char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(char_to_byte('A'), Some(b'A'));
        assert_eq!(char_to_byte('ÿ'), Some(0xff));
        assert_eq!(char_to_byte('\u{143}'), Some(0xad));
        assert_eq!(char_to_byte(' '), None);
        assert_eq!(byte_level_decode("Ġhello"), b" hello");
        assert_eq!(byte_level_decode("a\nb"), b"a\nb");
    }

    #[test]
    fn merges_split_at_first_inner_space() {
        let m = parse_merges(&["Ġ t", "a b"]).unwrap();
        assert_eq!(m, vec![("Ġ".into(), "t".into()), ("a".into(), "b".into())]);
        assert!(matches!(
            parse_merges(&["ab"]),
            Err(TokenizerError::BadMerge { index: 0, .. })
        ));
    }
}
