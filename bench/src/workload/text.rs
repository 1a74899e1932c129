//! Prompt content of a given length: token ids for the completions API, text for chat.
//!
//! Chat prompts must be text, and the client has no tokenizer, so text is made of common
//! English words that are one token each, with their leading space, in byte-level BPE
//! vocabularies (SmolLM2's, GPT-2's, Llama's): the pre-tokenizer splits before each space, and
//! each ` word` is then a single vocabulary entry, so N words are about N tokens. About, not
//! exactly (a chat template adds its own tokens, and a vocabulary may lack a word); the
//! server's `usage.prompt_tokens` is the exact count.

use std::ops::Range;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::Message;
use crate::load::Api;
use crate::trace::block_token_ids;
use crate::workload::Prompt;

/// Common English words, each one token with a leading space in byte-level BPE vocabularies
/// (every one is a `Ġword` entry of SmolLM2-135M's 49,152-token vocabulary, checked against
/// the GGUF's `tokenizer.ggml.tokens`). Lower case, letters only: the pre-tokenizer splits
/// before each space, so neighbours never merge.
pub const ONE_TOKEN_WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its", "may",
    "these", "about", "some", "what", "out", "them", "into", "than", "then", "only", "could",
    "time", "new", "two", "first", "also", "any", "like", "our", "over", "after", "most", "such",
    "made", "many", "years", "where", "work", "well", "people", "through", "back", "year", "good",
    "much", "before", "way", "day", "use", "each", "just", "life", "world", "long", "house",
    "water", "school", "place", "city", "home", "family", "country", "part", "system", "number",
    "group", "state", "name", "hand", "right", "small", "large", "old", "great", "high", "little",
    "own", "last", "best", "next", "early", "young", "few", "public", "under", "between", "never",
    "still", "while", "might", "every", "again", "same", "should", "since", "around", "without",
    "know", "take", "see", "come", "think", "look", "want", "give", "find", "tell", "ask", "seem",
    "feel", "try", "leave", "call", "keep", "help", "show", "play", "run", "move", "live", "read",
    "write", "learn", "change", "turn", "open", "start", "book", "food", "money", "power", "music",
    "story", "game", "word", "line", "light", "point", "road", "car", "tree", "river", "street",
    "room", "door", "table", "paper", "party", "team", "office", "market", "price", "week",
    "month", "night", "morning", "area", "level", "order", "form", "idea", "body", "face", "head",
    "eye", "voice", "love", "war", "peace", "field", "land", "sea", "air", "fire", "sun", "rain",
    "wind", "red", "blue", "green", "black", "white",
];

/// The words for `indices` (into [`ONE_TOKEN_WORDS`]), each with its leading space.
fn words(indices: impl Iterator<Item = u32>) -> String {
    let mut text = String::new();
    for i in indices {
        text.push(' ');
        text.push_str(ONE_TOKEN_WORDS[i as usize % ONE_TOKEN_WORDS.len()]);
    }
    text
}

fn word_range() -> Range<u32> {
    0..ONE_TOKEN_WORDS.len() as u32
}

/// The text standing for the block named `hash_id`: its first `len` words, the same wherever
/// the id appears (so a trace's shared prefixes are shared in text too).
pub fn block_text(hash_id: u64, len: usize) -> String {
    words(block_token_ids(hash_id, len, &word_range()))
}

/// Makes prompts of exact lengths that share nothing but an optional common prefix, for one
/// API, deterministically from a seed.
pub(crate) struct PromptMaker {
    api: Api,
    rng: StdRng,
    token_ids: Range<u32>,
    prefix: Option<Prefix>,
    /// Prompts made so far: the first token after the prefix is `token_ids.start +
    /// (first + made) % span`, distinct for every prompt of a run (below the span), so no two
    /// prompts share a prefix by chance.
    made: u64,
    first: u64,
}

enum Prefix {
    Tokens(Vec<u32>),
    Text(String),
}

impl PromptMaker {
    pub(crate) fn new(api: Api, seed: u64, token_ids: Range<u32>, prefix: Option<u32>) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let prefix = prefix.map(|n| match api {
            Api::Completions => {
                Prefix::Tokens((0..n).map(|_| rng.gen_range(token_ids.clone())).collect())
            }
            Api::Chat => Prefix::Text(words((0..n).map(|_| rng.gen_range(word_range())))),
        });
        let first = rng.gen();
        PromptMaker {
            api,
            rng,
            token_ids,
            prefix,
            made: 0,
            first,
        }
    }

    /// A prompt of `len` tokens (words, for chat) after the prefix.
    pub(crate) fn make(&mut self, len: u32) -> Prompt {
        let span = u64::from(self.token_ids.end - self.token_ids.start).max(1);
        let lead = self.token_ids.start + ((self.first.wrapping_add(self.made)) % span) as u32;
        self.made += 1;
        match self.api {
            Api::Completions => {
                let mut ids = match &self.prefix {
                    Some(Prefix::Tokens(p)) => p.clone(),
                    _ => Vec::with_capacity(len as usize),
                };
                ids.push(lead);
                ids.extend((1..len).map(|_| self.rng.gen_range(self.token_ids.clone())));
                Prompt::Tokens(ids)
            }
            Api::Chat => {
                let rng = &mut self.rng;
                let text = words((0..len).map(|_| rng.gen_range(word_range())));
                match &self.prefix {
                    Some(Prefix::Text(system)) => Prompt::Messages(vec![
                        Message {
                            role: "system".into(),
                            content: system.clone(),
                        },
                        Message {
                            role: "user".into(),
                            content: text,
                        },
                    ]),
                    _ => Prompt::Text(text),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_list_is_plain_lower_case_words() {
        assert!(ONE_TOKEN_WORDS.len() >= 200);
        let distinct: std::collections::HashSet<_> = ONE_TOKEN_WORDS.iter().collect();
        assert_eq!(distinct.len(), ONE_TOKEN_WORDS.len(), "no word twice");
        assert!(ONE_TOKEN_WORDS
            .iter()
            .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase())));
    }

    #[test]
    fn block_text_is_the_same_for_the_same_id() {
        assert_eq!(block_text(7, 10), block_text(7, 10));
        assert_ne!(block_text(7, 10), block_text(8, 10));
        assert!(block_text(7, 20).starts_with(&block_text(7, 10)));
        assert_eq!(block_text(7, 20).split_whitespace().count(), 20);
    }

    #[test]
    fn token_prompts_lead_with_distinct_tokens() {
        let mut maker = PromptMaker::new(Api::Completions, 3, 1000..1100, None);
        let leads: std::collections::HashSet<u32> = (0..100)
            .map(|_| match maker.make(5) {
                Prompt::Tokens(ids) => {
                    assert_eq!(ids.len(), 5);
                    assert!(ids.iter().all(|t| (1000..1100).contains(t)));
                    ids[0]
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(leads.len(), 100, "every prompt starts differently");
    }
}
