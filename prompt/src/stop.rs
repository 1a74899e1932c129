//! When a sequence stops: per token (EOS, stop token ids, `max_tokens`) and per decoded text
//! (stop strings). Text that could still turn out to be the start of a stop string is held
//! back, so a client never sees part of a stop string, even when the detokenizer delivers it
//! across several pieces.

use kvmesh_common::{FinishReason, SamplingParams, TokenId};

/// One sequence's stop conditions. See the module docs.
#[derive(Clone, Debug)]
pub struct StopChecker {
    /// `None` under `ignore_eos`.
    eos: Option<TokenId>,
    stop_token_ids: Vec<TokenId>,
    max_tokens: usize,
    /// Stop tokens count only after this many tokens, as the sampler masks them until then.
    min_tokens: usize,
    stop_strings: Vec<String>,
    /// Decoded text not yet returned: a suffix that may begin a stop string.
    held: String,
    stopped: bool,
}

impl StopChecker {
    /// `eos` is the model's end-of-sequence token, if it has one.
    pub fn new(params: &SamplingParams, eos: Option<TokenId>) -> Self {
        StopChecker {
            eos: eos.filter(|_| !params.ignore_eos),
            stop_token_ids: params.stop_token_ids.clone(),
            max_tokens: params.max_tokens as usize,
            min_tokens: params.min_tokens as usize,
            stop_strings: params
                .stop
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether generation ends with `token`, the `num_generated`-th generated token. A stop
    /// token wins over the length limit when both apply.
    pub fn check_token(&self, token: TokenId, num_generated: usize) -> Option<FinishReason> {
        let is_stop_token = Some(token) == self.eos || self.stop_token_ids.contains(&token);
        if is_stop_token && num_generated > self.min_tokens {
            Some(FinishReason::Stop)
        } else if num_generated >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Feeds the next piece of decoded text. Returns the text that is safe to send now and
    /// whether a stop string matched; the text then ends just before the stop string
    /// (`FinishReason::Stop`), and every later call returns nothing.
    ///
    /// Stop strings are matched from the first generated token on; `min_tokens` gates only
    /// stop tokens, which the sampler masks.
    pub fn push_text(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), false);
        }
        self.held.push_str(piece);
        if self.stop_strings.is_empty() {
            return (std::mem::take(&mut self.held), false);
        }
        // `held` had no complete stop string before this piece, so the earliest match is
        // the one a reader of the whole text would see first.
        let first_match = self
            .stop_strings
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_match {
            self.held.truncate(at);
            self.stopped = true;
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self.partial_match_len();
        (self.held.drain(..self.held.len() - keep).collect(), false)
    }

    /// Releases held-back text when the sequence ends for another reason (EOS, length,
    /// cancellation): without more text it cannot become a stop string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string. It
    /// starts where a stop string starts, so it is always on a char boundary.
    fn partial_match_len(&self) -> usize {
        let held = self.held.as_bytes();
        self.stop_strings
            .iter()
            .filter_map(|s| {
                let s = s.as_bytes();
                (1..s.len().min(held.len() + 1))
                    .rev()
                    .find(|&k| held.ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checker(stop: &[&str]) -> StopChecker {
        let params = SamplingParams {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            max_tokens: 100,
            ..Default::default()
        };
        StopChecker::new(&params, Some(2))
    }

    /// Feeds pieces, returns the text sent and the finish reason.
    fn feed(c: &mut StopChecker, pieces: &[&str]) -> (String, Option<FinishReason>) {
        let mut out = String::new();
        for piece in pieces {
            let (text, stopped) = c.push_text(piece);
            out.push_str(&text);
            if stopped {
                return (out, Some(FinishReason::Stop));
            }
        }
        (out, None)
    }

    #[test]
    fn eos_stop_tokens_and_length() {
        let params = SamplingParams {
            stop_token_ids: vec![7],
            max_tokens: 3,
            ..Default::default()
        };
        let c = StopChecker::new(&params, Some(2));
        assert_eq!(c.check_token(5, 1), None);
        assert_eq!(c.check_token(2, 1), Some(FinishReason::Stop));
        assert_eq!(c.check_token(7, 2), Some(FinishReason::Stop));
        assert_eq!(c.check_token(5, 3), Some(FinishReason::Length));
        assert_eq!(c.check_token(2, 3), Some(FinishReason::Stop));
    }

    #[test]
    fn ignore_eos_and_min_tokens() {
        let ignore = SamplingParams {
            ignore_eos: true,
            ..Default::default()
        };
        assert_eq!(StopChecker::new(&ignore, Some(2)).check_token(2, 1), None);
        let min = SamplingParams {
            min_tokens: 2,
            ..Default::default()
        };
        let c = StopChecker::new(&min, Some(2));
        assert_eq!(c.check_token(2, 2), None);
        assert_eq!(c.check_token(2, 3), Some(FinishReason::Stop));
    }

    #[test]
    fn text_without_stop_strings_passes_straight_through() {
        let mut c = checker(&[]);
        assert_eq!(
            feed(&mut c, &["Hello", " world"]),
            ("Hello world".into(), None)
        );
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_held_back_and_cut() {
        let mut c = checker(&["world"]);
        assert_eq!(c.push_text("Hel"), ("Hel".into(), false));
        assert_eq!(c.push_text("lo wor"), ("lo ".into(), false));
        assert_eq!(c.push_text("ld!"), ("".into(), true));
        assert_eq!(c.push_text("more"), ("".into(), false));
    }

    #[test]
    fn a_false_start_is_released() {
        let mut c = checker(&["abc"]);
        assert_eq!(c.push_text("xab").0, "x");
        assert_eq!(c.push_text("d").0, "abd");
        assert_eq!(c.push_text("ab").0, "");
        assert_eq!(c.flush(), "ab");
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let mut c = checker(&["cd", "b"]);
        assert_eq!(
            feed(&mut c, &["abcd"]),
            ("a".into(), Some(FinishReason::Stop))
        );
        let mut c = checker(&["xyz", "yz1"]);
        assert_eq!(
            feed(&mut c, &["0x", "y", "z1"]),
            ("0".into(), Some(FinishReason::Stop))
        );
        // A stop string that completes first ends generation, even if a longer one that
        // starts earlier would have completed with more text.
        let mut c = checker(&["aéé", "é"]);
        assert_eq!(
            feed(&mut c, &[" aé", "é"]),
            (" a".into(), Some(FinishReason::Stop))
        );
        let mut c = checker(&["aéé", "é"]);
        assert_eq!(
            feed(&mut c, &[" aéé"]),
            (" ".into(), Some(FinishReason::Stop))
        );
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let mut c = checker(&["é!"]);
        assert_eq!(
            feed(&mut c, &["caf", "é", "!", "x"]),
            ("caf".into(), Some(FinishReason::Stop))
        );
        let mut c = checker(&["éa"]);
        assert_eq!(feed(&mut c, &["ééb"]), ("ééb".into(), None));
    }

    proptest::proptest! {
        /// However the text is split into pieces, what is sent is what a naive re-scan
        /// gives: after each piece, the earliest stop string in all the text so far ends the
        /// output there (or, without one, all of it is sent after `flush`). Generation stops
        /// at the first piece that completes a stop string, as vLLM and OpenAI do, so with
        /// overlapping stop strings the split decides which one is seen first: " aé" + "é"
        /// with stops "aéé" and "é" stops at "é", while " aéé" in one piece stops at "aéé".
        #[test]
        fn splitting_matches_a_naive_rescan(
            text in "[abé ]{0,30}",
            stops in proptest::collection::vec("[abé]{1,3}", 1..3),
            cuts in proptest::collection::vec(0usize..40, 0..8),
        ) {
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let mut bounds: Vec<usize> = cuts.into_iter().filter(|&c| text.is_char_boundary(c)).collect();
            bounds.extend([0, text.len()]);
            bounds.sort_unstable();
            bounds.dedup();
            let pieces: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            let expected = bounds[1..].iter().find_map(|&end| {
                stops.iter().filter_map(|s| text[..end].find(s.as_str())).min()
            });

            let mut c = checker(&stop_refs);
            let (mut sent, finish) = feed(&mut c, &pieces);
            match expected {
                Some(at) => {
                    proptest::prop_assert_eq!(finish, Some(FinishReason::Stop));
                    proptest::prop_assert_eq!(&sent, &text[..at]);
                }
                None => {
                    proptest::prop_assert_eq!(finish, None);
                    sent.push_str(&c.flush());
                    proptest::prop_assert_eq!(&sent, &text);
                }
            }
        }
    }
}
