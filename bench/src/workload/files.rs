//! Prompt files: JSONL (a prompt or a conversation a line) and ShareGPT.

use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::de::{DeserializeSeed, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;

use super::{
    line_error, open, Message, Prompt, WorkItem, WorkloadError, WorkloadOptions, DEFAULT_MAX_TOKENS,
};
use crate::load::Api;
use crate::trace::{read_bounded_line, MAX_LINE_BYTES};

/// Characters per token in the estimate of a ShareGPT reply's length: about four for English
/// text in BPE vocabularies (a reply of 400 characters counts as 100 tokens).
pub const CHARS_PER_TOKEN: usize = 4;

/// One line of a JSONL prompt file (other fields are ignored).
#[derive(Deserialize)]
struct JsonlLine {
    prompt: Option<JsonlPrompt>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<u32>,
    output_tokens: Option<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum JsonlPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

pub(super) fn jsonl_items(
    path: &Path,
    opts: &WorkloadOptions,
) -> Result<Vec<WorkItem>, WorkloadError> {
    parse_jsonl(
        BufReader::new(open(path)?),
        &path.display().to_string(),
        opts,
    )
}

/// At most `opts.requests` items from JSONL; errors name `file` and the 1-based line.
pub(super) fn parse_jsonl<R: BufRead>(
    mut reader: R,
    file: &str,
    opts: &WorkloadOptions,
) -> Result<Vec<WorkItem>, WorkloadError> {
    let malformed = |line, message: String| WorkloadError::Malformed {
        file: file.to_owned(),
        line,
        message,
    };
    let (mut items, mut buf, mut line) = (Vec::new(), Vec::new(), 0);
    while items.len() < opts.requests {
        line += 1;
        if !read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES)
            .map_err(|e| line_error(file, line, e))?
        {
            break;
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let l: JsonlLine =
            serde_json::from_slice(&buf).map_err(|e| malformed(line, e.to_string()))?;
        let prompt = match (l.prompt, l.messages) {
            (Some(_), Some(_)) => {
                return Err(malformed(line, "give one of prompt and messages".into()))
            }
            (None, None) => return Err(malformed(line, "expected prompt or messages".into())),
            (Some(JsonlPrompt::Text(t)), None) if t.is_empty() => {
                return Err(malformed(line, "the prompt is empty".into()))
            }
            (Some(JsonlPrompt::Text(t)), None) => Prompt::Text(t),
            (Some(JsonlPrompt::Tokens(ids)), None) => {
                if ids.is_empty() {
                    return Err(malformed(line, "the prompt is empty".into()));
                }
                if opts.api == Api::Chat {
                    return Err(WorkloadError::TokensForChat {
                        file: file.to_owned(),
                        line,
                    });
                }
                Prompt::Tokens(ids)
            }
            (None, Some(messages)) => {
                if messages.is_empty() {
                    return Err(malformed(line, "messages is empty".into()));
                }
                if opts.api == Api::Completions {
                    return Err(WorkloadError::MessagesForCompletions {
                        file: file.to_owned(),
                        line,
                    });
                }
                Prompt::Messages(messages)
            }
        };
        let max_tokens = match (l.max_tokens, l.output_tokens) {
            (Some(a), Some(b)) if a != b => {
                return Err(malformed(
                    line,
                    format!("max_tokens {a} and output_tokens {b} disagree"),
                ))
            }
            (Some(0), _) | (_, Some(0)) => {
                return Err(malformed(
                    line,
                    "the output length must be at least 1".into(),
                ))
            }
            (Some(n), _) | (None, Some(n)) => opts.cap_output(n),
            (None, None) => opts.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        };
        items.push(WorkItem {
            prompt,
            max_tokens,
            at: None,
            previous_turn: None,
            hash_ids: Vec::new(),
        });
    }
    Ok(items)
}

/// One ShareGPT conversation (other fields, such as `id`, are ignored).
#[derive(Deserialize)]
struct Conversation {
    #[serde(default)]
    conversations: Vec<Turn>,
}

#[derive(Deserialize)]
struct Turn {
    from: String,
    value: String,
}

/// A ShareGPT speaker as a chat role.
fn role(from: &str) -> Option<&'static str> {
    match from {
        "human" | "user" => Some("user"),
        "gpt" | "chatgpt" | "bard" | "bing" | "assistant" => Some("assistant"),
        "system" => Some("system"),
        _ => None,
    }
}

/// The request a conversation asks for: its messages up to the first human turn, and the
/// estimated length of the reply after it; `None` without both.
fn request(c: Conversation, api: Api) -> Option<(Prompt, u32)> {
    let first_user = c
        .conversations
        .iter()
        .position(|t| role(&t.from) == Some("user"))?;
    let reply = c.conversations.get(first_user + 1)?;
    if role(&reply.from) != Some("assistant") || c.conversations[first_user].value.is_empty() {
        return None;
    }
    let estimate = reply.value.chars().count().div_ceil(CHARS_PER_TOKEN).max(1);
    let estimate = u32::try_from(estimate).unwrap_or(u32::MAX);
    let mut turns = c.conversations;
    turns.truncate(first_user + 1);
    let prompt = match api {
        Api::Completions => Prompt::Text(turns.pop()?.value),
        Api::Chat => Prompt::Messages(
            turns
                .into_iter()
                .filter_map(|t| {
                    Some(Message {
                        role: role(&t.from)?.to_owned(),
                        content: t.value,
                    })
                })
                .collect(),
        ),
    };
    Some((prompt, estimate))
}

/// Reads the array one conversation at a time, keeping at most `limit` requests; the rest
/// is parsed (the file must be valid JSON) but not kept, so memory stays bounded.
struct Requests<'a> {
    api: Api,
    limit: usize,
    out: &'a mut Vec<(Prompt, u32)>,
}

impl<'de> DeserializeSeed<'de> for Requests<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Requests<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a JSON array of ShareGPT conversations")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while self.out.len() < self.limit {
            match seq.next_element::<Conversation>()? {
                Some(c) => self.out.extend(request(c, self.api)),
                None => return Ok(()),
            }
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

pub(super) fn sharegpt_items(
    path: &Path,
    opts: &WorkloadOptions,
) -> Result<Vec<WorkItem>, WorkloadError> {
    parse_sharegpt(
        BufReader::new(open(path)?),
        &path.display().to_string(),
        opts,
    )
}

/// The first `opts.requests` usable conversations of a ShareGPT file, in file order; errors
/// name `file` and the line.
pub(super) fn parse_sharegpt<R: std::io::Read>(
    reader: R,
    file: &str,
    opts: &WorkloadOptions,
) -> Result<Vec<WorkItem>, WorkloadError> {
    let mut out = Vec::new();
    let mut de = serde_json::Deserializer::from_reader(reader);
    Requests {
        api: opts.api,
        limit: opts.requests,
        out: &mut out,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end())
    .map_err(|e| WorkloadError::Malformed {
        file: file.to_owned(),
        line: e.line(),
        message: e.to_string(),
    })?;
    Ok(out
        .into_iter()
        .map(|(prompt, estimate)| WorkItem {
            prompt,
            max_tokens: opts.max_tokens.unwrap_or(estimate),
            at: None,
            previous_turn: None,
            hash_ids: Vec::new(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(api: Api) -> WorkloadOptions {
        WorkloadOptions::new(api, 100)
    }

    #[test]
    fn jsonl_lines_become_prompts() {
        let text = r#"{"prompt": "hello", "max_tokens": 5}
{"prompt": [1, 2, 3], "output_tokens": 7, "id": "x"}

{"prompt": "no length"}
"#;
        let items = parse_jsonl(text.as_bytes(), "p.jsonl", &opts(Api::Completions)).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(items[0].prompt, Prompt::Text("hello".into()));
        assert_eq!(items[1].prompt, Prompt::Tokens(vec![1, 2, 3]));
        let lens: Vec<u32> = items.iter().map(|i| i.max_tokens).collect();
        assert_eq!(lens, [5, 7, DEFAULT_MAX_TOKENS]);
        let capped = WorkloadOptions {
            max_tokens: Some(6),
            ..opts(Api::Completions)
        };
        let items = parse_jsonl(text.as_bytes(), "p.jsonl", &capped).unwrap();
        let lens: Vec<u32> = items.iter().map(|i| i.max_tokens).collect();
        assert_eq!(lens, [5, 6, 6], "capped where given, replaced where absent");
    }

    #[test]
    fn jsonl_errors_name_the_line() {
        let err = |text: &str, api| {
            parse_jsonl(text.as_bytes(), "p.jsonl", &opts(api))
                .unwrap_err()
                .to_string()
        };
        let e = err("{\"prompt\": \"a\"}\n{\"prompt\": \n", Api::Completions);
        assert!(e.starts_with("p.jsonl line 2: "), "{e}");
        let e = err("\n{\"prompt\": [1]}\n", Api::Chat);
        assert!(
            e.starts_with("p.jsonl line 2: a prompt of token ids needs"),
            "{e}"
        );
        let e = err(
            r#"{"messages": [{"role": "user", "content": "a"}]}"#,
            Api::Completions,
        );
        assert!(e.contains("line 1: chat messages need the chat API"), "{e}");
        let e = err(r#"{"text": "a"}"#, Api::Chat);
        assert!(e.contains("line 1: expected prompt or messages"), "{e}");
        let e = err(r#"{"prompt": "a", "max_tokens": 0}"#, Api::Chat);
        assert!(e.contains("at least 1"), "{e}");
        let long = format!("{}\n", " ".repeat(MAX_LINE_BYTES + 1));
        assert!(matches!(
            parse_jsonl(long.as_bytes(), "p", &opts(Api::Chat)),
            Err(WorkloadError::LineTooLong { line: 1, .. })
        ));
    }

    #[test]
    fn sharegpt_first_human_turn_is_the_prompt() {
        let text = r#"[
 {"id": "a", "conversations": [{"from": "system", "value": "be brief"},
   {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there!"},
   {"from": "human", "value": "more"}]},
 {"id": "b", "conversations": [{"from": "gpt", "value": "alone"}]},
 {"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "abcde"}]}
]"#;
        let chat = parse_sharegpt(text.as_bytes(), "s.json", &opts(Api::Chat)).unwrap();
        assert_eq!(
            chat.len(),
            2,
            "a conversation without a human turn is skipped"
        );
        let Prompt::Messages(m) = &chat[0].prompt else {
            panic!("{:?}", chat[0].prompt)
        };
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user"]);
        assert_eq!(m[1].content, "hi");
        // 12 and 5 characters: 3 and 2 tokens.
        assert_eq!((chat[0].max_tokens, chat[1].max_tokens), (3, 2));
        let plain = parse_sharegpt(text.as_bytes(), "s.json", &opts(Api::Completions)).unwrap();
        assert_eq!(plain[0].prompt, Prompt::Text("hi".into()));
        let one = WorkloadOptions {
            requests: 1,
            max_tokens: Some(9),
            ..opts(Api::Chat)
        };
        let first = parse_sharegpt(text.as_bytes(), "s.json", &one).unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].max_tokens, 9, "the estimate is overridden");
        let e = parse_sharegpt("[{\"conversations\": 3}]".as_bytes(), "s.json", &one)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("s.json line 1: "), "{e}");
        let e = parse_sharegpt("[]\n]".as_bytes(), "s.json", &one)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("s.json line 2: "), "{e}");
    }
}
