//! Prompts -> token ids: the chat template for `/v1/chat/completions`, plain text or ids for
//! `/v1/completions`.
//!
//! **Special tokens.** Chat prompts are rendered and then tokenized with special-token
//! parsing, as HF's `apply_chat_template` and vLLM do, so the template's `<|im_start|>`
//! markers become their ids. Unlike them, text that *message content* contributes never
//! becomes a special token: when some content contains the text of a special token, the
//! template is rendered with each content replaced by a placeholder, the template's own text
//! is tokenized with specials and each content literally. (Content without such text, the
//! common case, takes the first path, which yields the same ids as HF.) A user cannot forge
//! a turn boundary by typing `<|im_end|>`. Completion prompts are the client's own raw
//! text, so they are tokenized with specials parsed.
//!
//! BOS/EOS: like `apply_chat_template(tokenize=True)`, chat prompts get no automatic BOS/EOS
//! (templates write `bos_token` themselves); completion prompts get what the model's
//! metadata asks for.

use std::sync::{Arc, OnceLock};

use kvmesh_common::{Constraint, TokenId};
use kvmesh_prompt::chat_template::{ChatMessage, ChatTemplate, ChatTemplateError};
use kvmesh_prompt::grammar::{GrammarError, Grammars};
use kvmesh_prompt::tokenizer::Tokenizer;

use crate::error::ApiError;

/// Placeholder brackets (private-use characters) for message content in the slow path.
const OPEN: char = '\u{F0000}';
const CLOSE: char = '\u{F0001}';

enum Template {
    Ready(Box<ChatTemplate>),
    /// The model has none: chat requests are a client error (use completions).
    Missing,
    /// It does not compile: chat requests are a server error.
    Broken(String),
}

/// Turns request prompts into token ids.
pub(crate) struct Prompts {
    tokenizer: Arc<Tokenizer>,
    /// Compiles structured-output constraints, built on the first one.
    grammars: OnceLock<Result<Grammars, GrammarError>>,
    template: Template,
    /// Text of every special token, to spot them in message content.
    specials: Vec<String>,
    /// What `encode` adds before / after any text (BOS/EOS per the model's metadata).
    prefix: Vec<TokenId>,
    suffix: Vec<TokenId>,
    /// The fill-in-the-middle tokens (prefix, suffix, middle), if the model has them.
    fim: Option<[TokenId; 3]>,
}

impl Prompts {
    pub(crate) fn new(tokenizer: Arc<Tokenizer>) -> Self {
        let template = match ChatTemplate::from_tokenizer(&tokenizer) {
            Ok(t) => Template::Ready(Box::new(t)),
            Err(ChatTemplateError::NoTemplate) => Template::Missing,
            Err(e) => {
                tracing::warn!(error = %e, "chat template unusable; /v1/chat/completions will fail");
                Template::Broken(e.to_string())
            }
        };
        let mut specials: Vec<String> = tokenizer
            .special_ids()
            .into_iter()
            .map(|id| tokenizer.decode(&[id], false))
            .filter(|t| !t.is_empty())
            .collect();
        specials.sort();
        let (prefix, suffix) = affixes(&tokenizer);
        let fim = fim_tokens(&tokenizer);
        Prompts {
            fim,
            tokenizer,
            grammars: OnceLock::new(),
            template,
            specials,
            prefix,
            suffix,
        }
    }

    /// Whether `constraint` compiles over this model's vocabulary (what is wrong if not).
    pub(crate) fn check_constraint(&self, constraint: &Constraint) -> Result<(), GrammarError> {
        let grammars = self
            .grammars
            .get_or_init(|| Grammars::new(self.tokenizer.clone()));
        match grammars {
            Ok(g) => g.start(constraint).map(drop),
            Err(e) => Err(GrammarError(format!(
                "structured outputs are unavailable: {e}"
            ))),
        }
    }

    pub(crate) fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub(crate) fn tokenizer_arc(&self) -> Arc<Tokenizer> {
        self.tokenizer.clone()
    }

    /// The prompt of a chat request, ready for the assistant's turn.
    pub(crate) fn chat(&self, messages: &[ChatMessage]) -> Result<Vec<TokenId>, ApiError> {
        let template = match &self.template {
            Template::Ready(t) => t,
            Template::Missing => {
                return Err(ApiError::invalid(
                    "messages",
                    "this model has no chat template; use /v1/completions with a raw prompt",
                ))
            }
            Template::Broken(e) => return Err(ApiError::Internal(e.clone())),
        };
        let render = |messages: &[ChatMessage]| {
            template.render(messages, true).map_err(|e| match e {
                ChatTemplateError::Raised(msg) => ApiError::invalid("messages", msg),
                e => ApiError::invalid("messages", e.to_string()),
            })
        };
        if !messages.iter().any(|m| self.has_special_text(&m.content)) {
            let text = render(messages)?;
            return Ok(self.strip_affixes(self.encode(&text, true)?));
        }
        let placeholders: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage::new(m.role.clone(), format!("{OPEN}{i}{CLOSE}")))
            .collect();
        let skeleton = render(&placeholders)?;
        let mut ids = Vec::new();
        for piece in split_placeholders(&skeleton) {
            let part = match piece {
                Piece::Template(text) => self.encode(text, true)?,
                Piece::Content(i) => match messages.get(i) {
                    Some(m) => self.encode(&m.content, false)?,
                    None => Vec::new(),
                },
            };
            ids.extend(self.strip_affixes(part));
        }
        Ok(ids)
    }

    /// A completion prompt given as text.
    pub(crate) fn text(&self, prompt: &str) -> Result<Vec<TokenId>, ApiError> {
        self.encode(prompt, true)
    }

    /// A fill-in-the-middle prompt (completions' `suffix`), prefix-suffix-middle as code
    /// models are trained on: `<fim_prefix>` prefix `<fim_suffix>` suffix `<fim_middle>`,
    /// the answer being the middle. `prefix` is the prompt's ids (with whatever BOS the model
    /// adds); the suffix is text. Refused for a model without such tokens.
    pub(crate) fn fill_in_middle(
        &self,
        mut prefix: Vec<TokenId>,
        suffix: &str,
    ) -> Result<Vec<TokenId>, ApiError> {
        let [pre, suf, mid] = self.fim.ok_or_else(|| {
            ApiError::unsupported(
                "suffix",
                "`suffix` needs a model with fill-in-the-middle tokens (<fim_prefix>, \
                 <fim_suffix>, <fim_middle>); this one has none",
            )
        })?;
        if !self.suffix.is_empty() && prefix.ends_with(&self.suffix) {
            prefix.truncate(prefix.len() - self.suffix.len());
        }
        let lead = self.prefix.len() * usize::from(prefix.starts_with(&self.prefix));
        prefix.insert(lead, pre);
        prefix.push(suf);
        prefix.extend(self.strip_affixes(self.encode(suffix, false)?));
        prefix.push(mid);
        Ok(prefix)
    }

    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<TokenId>, ApiError> {
        self.tokenizer
            .encode(text, parse_special)
            .map_err(|e| ApiError::Internal(format!("tokenizing the prompt: {e}")))
    }

    fn has_special_text(&self, content: &str) -> bool {
        self.specials.iter().any(|s| content.contains(s.as_str()))
    }

    fn strip_affixes(&self, mut ids: Vec<TokenId>) -> Vec<TokenId> {
        if !self.suffix.is_empty() && ids.ends_with(&self.suffix) {
            ids.truncate(ids.len() - self.suffix.len());
        }
        if !self.prefix.is_empty() && ids.starts_with(&self.prefix) {
            ids.drain(..self.prefix.len());
        }
        ids
    }
}

/// The fill-in-the-middle tokens under the names code models use (StarCoder's
/// `<fim_prefix>`, Qwen-Coder's and CodeGemma's `<|fim_prefix|>`).
fn fim_tokens(tokenizer: &Tokenizer) -> Option<[TokenId; 3]> {
    [("<fim_", ">"), ("<|fim_", "|>")]
        .into_iter()
        .find_map(|(open, close)| {
            let id = |part: &str| tokenizer.token_id(&format!("{open}{part}{close}"));
            Some([id("prefix")?, id("suffix")?, id("middle")?])
        })
}

/// The ids `encode` puts around every text: a leading run of BOS, then the rest (EOS).
fn affixes(tokenizer: &Tokenizer) -> (Vec<TokenId>, Vec<TokenId>) {
    let ids = tokenizer.encode("", false).unwrap_or_default();
    let bos = tokenizer.bos_token_id();
    let lead = ids.iter().take_while(|&&id| Some(id) == bos).count();
    (ids[..lead].to_vec(), ids[lead..].to_vec())
}

#[derive(Debug, PartialEq)]
enum Piece<'a> {
    Template(&'a str),
    Content(usize),
}

/// Splits a rendered skeleton at `OPEN<i>CLOSE` placeholders.
fn split_placeholders(s: &str) -> Vec<Piece<'_>> {
    let mut pieces = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len_utf8()..];
        let parsed = after
            .find(CLOSE)
            .and_then(|end| after[..end].parse::<usize>().ok().map(|i| (i, end)));
        match parsed {
            Some((i, end)) => {
                if start > 0 {
                    pieces.push(Piece::Template(&rest[..start]));
                }
                pieces.push(Piece::Content(i));
                rest = &after[end + CLOSE.len_utf8()..];
            }
            None => {
                // Not a placeholder of ours: keep it as template text.
                let skip = start + OPEN.len_utf8();
                pieces.push(Piece::Template(&rest[..skip]));
                rest = &rest[skip..];
            }
        }
    }
    if !rest.is_empty() {
        pieces.push(Piece::Template(rest));
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_placeholders() {
        let s = format!("<a>{OPEN}0{CLOSE}<b>{OPEN}12{CLOSE}{OPEN}x");
        assert_eq!(
            split_placeholders(&s),
            vec![
                Piece::Template("<a>"),
                Piece::Content(0),
                Piece::Template("<b>"),
                Piece::Content(12),
                Piece::Template(&s[s.len() - OPEN.len_utf8() - 1..s.len() - 1]),
                Piece::Template("x"),
            ]
        );
        assert_eq!(split_placeholders(""), vec![]);
    }
}
