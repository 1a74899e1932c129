//! Structured outputs: a [`Constraint`] compiled (with llguidance) over one tokenizer's
//! vocabulary into a per-sequence [`ConstrainedSequence`] that masks the tokens breaking it
//! before each draw and follows the tokens drawn.
//!
//! The router compiles a request's constraint once to refuse a bad one with a clear message
//! (400) before any work; each engine compiles it again for the sequence it runs (a JSON
//! schema compiles in about a millisecond).

use crate::tokenizer::Tokenizer;
use kvmesh_common::{Constraint, TokenId};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenizerEnv};
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
    /// Sets every token that would break the grammar to -inf in `logits` (the end-of-sequence
    /// token is allowed once the text is complete).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError(e.to_string()))?;
        // Logits past the tokenizer's vocabulary (padding rows of the output layer) never fit.
        for (id, logit) in logits.iter_mut().enumerate() {
            if id >= allowed.len() || !allowed.is_allowed(id as TokenId) {
                *logit = f32::NEG_INFINITY;
            }
        }
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

    /// Whether the text is complete and nothing more may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
