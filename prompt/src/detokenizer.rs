//! Incremental detokenization for streaming: each generated token yields the text it
//! completes. Byte tokens can split a UTF-8 character (an emoji is often 2-4 tokens), so
//! bytes are held back until they form whole characters; bytes that can never become a
//! character come out as U+FFFD exactly where `String::from_utf8_lossy` would put them.
//! Hence the pieces always concatenate to `Tokenizer::decode` of the whole sequence.

use kvmesh_common::TokenId;

use crate::tokenizer::Tokenizer;

#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer {
    /// Bytes of an unfinished character.
    pending: Vec<u8>,
    skip_special: bool,
}

impl IncrementalDetokenizer {
    /// Starts after `prompt_ids` (may be empty), skipping special tokens. Only the
    /// prompt's unfinished trailing character matters: its bytes are carried so that the
    /// first generated token can complete it.
    pub fn new(tokenizer: &Tokenizer, prompt_ids: &[TokenId]) -> Self {
        Self::with_options(tokenizer, prompt_ids, true)
    }

    /// Like [`Self::new`]; `skip_special = false` also emits special tokens' text.
    pub fn with_options(tokenizer: &Tokenizer, prompt_ids: &[TokenId], skip_special: bool) -> Self {
        let mut d = IncrementalDetokenizer {
            pending: Vec::new(),
            skip_special,
        };
        // An unfinished character is at most 3 bytes and decoding resynchronises at its
        // lead byte, so replaying the tokens that hold the last 4 bytes is enough.
        let mut start = prompt_ids.len();
        let mut bytes = 0;
        while start > 0 && bytes < 4 {
            start -= 1;
            if !(skip_special && tokenizer.is_special(prompt_ids[start])) {
                bytes += tokenizer
                    .token_bytes(prompt_ids[start])
                    .map_or(0, <[u8]>::len);
            }
        }
        for &id in &prompt_ids[start..] {
            d.push(tokenizer, id);
        }
        d
    }

    /// Appends one token and returns the text it completes (often empty for byte tokens).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: TokenId) -> String {
        if self.skip_special && tokenizer.is_special(id) {
            return String::new();
        }
        self.pending
            .extend_from_slice(tokenizer.token_bytes(id).unwrap_or_default());
        self.drain(false)
    }

    /// Ends the stream: held-back bytes of an unfinished character become U+FFFD.
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    /// Whether bytes are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut rest = &self.pending[..];
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("valid prefix"));
                    match e.error_len() {
                        // Invalid bytes: no later byte can repair them.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                        // An unfinished character at the end.
                        None if at_end => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}
