//! Structured outputs: a [`Constraint`] compiled (with llguidance) over one tokenizer's
//! vocabulary into a per-sequence [`ConstrainedSequence`] that masks the tokens breaking it
//! before each draw ([`AllowedTokens`], computable while the model runs), follows the tokens
//! drawn, and names the tokens it forces (appended without a draw).
//!
//! The router compiles a request's constraint once to refuse a bad one with a clear message
//! (400) before any work; each engine compiles it again for the sequence it runs (a JSON
//! schema compiles in about a millisecond).

use crate::tokenizer::Tokenizer;
use kvmesh_common::{Constraint, TokenId};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// A constraint that cannot be compiled, or a sequence that left it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// The vocabulary as llguidance sees it: each token's bytes, special tokens marked so that no
/// grammar can spell them as text; strings tokenized with the model's own tokenizer.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// Compiles constraints for one tokenizer. Build once per model and share.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, GrammarError> {
        let eos = tokenizer
            .eos_token_id()
            .ok_or_else(|| GrammarError("the tokenizer has no end-of-sequence token".into()))?;
        let words: Vec<Vec<u8>> = (0..tokenizer.vocab_size() as TokenId)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                if tokenizer.is_special(id) {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER], bytes].concat()
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory =
            ParserFactory::new_simple(&(env as _)).map_err(|e| GrammarError(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh sequence under `constraint`; an error says what is wrong with it.
    pub fn start(&self, constraint: &Constraint) -> Result<ConstrainedSequence, GrammarError> {
        let grammar = match constraint {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(json_layout(
                serde_json::json!({"type": "object"}),
            )),
            Constraint::JsonSchema { schema } => {
                TopLevelGrammar::from_json_schema(json_layout(schema.clone()))
            }
            Constraint::Regex { pattern } => TopLevelGrammar::from_regex(pattern),
            Constraint::Choice { options } => {
                if options.is_empty() {
                    return Err(GrammarError("a choice needs at least one option".into()));
                }
                let alternatives: Vec<String> = options.iter().map(|o| lark_string(o)).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Constraint::Grammar { lark } => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(GrammarError(e)),
            None => Ok(ConstrainedSequence { matcher }),
        }
    }
}

/// JSON laid out as `json.dumps` does (`{"a": 1, "b": [2, 3]}`), unless the schema sets its
/// own layout: with free whitespace a model can pad its answer with newlines until
/// `max_tokens` and never close it.
pub fn json_layout(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// `s` as a Lark string literal.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// One sequence's position in its grammar.
pub struct ConstrainedSequence {
    matcher: Matcher,
}

impl std::fmt::Debug for ConstrainedSequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstrainedSequence")
    }
}

impl ConstrainedSequence {
    /// The tokens that keep the text in the grammar at the next position (the end-of-sequence
    /// token once the text is complete). Reads the state only: compute it while the model
    /// computes the logits, then [`AllowedTokens::apply`] it.
    pub fn allowed_tokens(&mut self) -> Result<AllowedTokens, GrammarError> {
        self.matcher
            .compute_mask_or_eos()
            .map(AllowedTokens)
            .map_err(|e| GrammarError(e.to_string()))
    }

    /// Sets every token that would break the grammar to -inf in `logits` (the end-of-sequence
    /// token is allowed once the text is complete).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        self.allowed_tokens()?.apply(logits);
        Ok(())
    }

    /// Follows a drawn (or replayed) token.
    pub fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError(e.to_string()))
    }

    /// The tokens the grammar forces next (the fixed keys and punctuation of a JSON schema):
    /// a sequence may append them without a draw each, [`accept`](Self::accept)ing each.
    /// Empty when the next token is a choice, the text is complete or the grammar is in
    /// error. They are the canonical tokenization of the forced text, so the model reads them
    /// as it would read them in a prompt; forced bytes that a longer token could still cover
    /// are left to the next draw.
    pub fn forced_tokens(&mut self) -> Vec<TokenId> {
        if self.matcher.is_stopped() {
            return Vec::new();
        }
        self.matcher.compute_ff_tokens()
    }

    /// Whether the text is complete and nothing more may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// The tokens a grammar allows at one position: a bit per vocabulary entry.
#[derive(Clone)]
pub struct AllowedTokens(SimpleVob);

impl std::fmt::Debug for AllowedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AllowedTokens({} of {})", self.0.num_set(), self.0.len())
    }
}

impl AllowedTokens {
    /// Sets the logit of every token not allowed to -inf; logits past the tokenizer's
    /// vocabulary (padding rows of the output layer) never fit. A word of the bitset at a
    /// time: most words of a mask are all zeros or all ones.
    pub fn apply(&self, logits: &mut [f32]) {
        let len = self.0.len();
        let words = self.0.as_slice();
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            let mut word = words.get(i).copied().unwrap_or(0);
            let start = i * 32;
            if start + 32 > len {
                // The last word's bits past the vocabulary.
                word &= (1u64 << len.saturating_sub(start).min(32)).wrapping_sub(1) as u32;
            }
            match word {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
    }

    pub fn is_allowed(&self, token: TokenId) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }
}
