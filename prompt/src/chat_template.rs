//! Renders a model's Jinja chat template (`tokenizer.chat_template`) the way HF
//! transformers does: `messages`, `add_generation_prompt`, `bos_token`/`eos_token`,
//! `raise_exception` and `strftime_now`, trim_blocks + lstrip_blocks, and Python string
//! methods (`.strip()`, `.startswith()`, ...) via minijinja-contrib.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::tokenizer::Tokenizer;

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("the model has no chat template (no `tokenizer.chat_template`); use the completions API with a raw prompt")]
    NoTemplate,
    #[error("the chat template does not compile: {0}")]
    Syntax(#[source] Error),
    /// The template rejected the messages (e.g. roles that do not alternate).
    #[error("the chat template rejected the messages: {0}")]
    Raised(String),
    #[error("rendering the chat template failed: {0}")]
    Render(#[source] Error),
}

/// Marks errors from `raise_exception` so they can be told from template bugs.
const RAISED: &str = "raise_exception: ";
const TEMPLATE: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        // HF renders with these Jinja options.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{msg}"),
            ))
        });
        env.add_function("strftime_now", |format: String| {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            strftime_utc(&format, now.as_secs() as i64)
        });
        env.add_template_owned(TEMPLATE, source.to_string())
            .map_err(ChatTemplateError::Syntax)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The model's own template, with its BOS/EOS token text.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self, ChatTemplateError> {
        let source = tokenizer
            .chat_template()
            .ok_or(ChatTemplateError::NoTemplate)?;
        let text = |id: Option<u32>| {
            id.map(|id| tokenizer.decode(&[id], false))
                .unwrap_or_default()
        };
        Self::new(
            source,
            text(tokenizer.bos_token_id()),
            text(tokenizer.eos_token_id()),
        )
    }

    /// The prompt text for `messages`; `add_generation_prompt` opens the assistant turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE)
            .map_err(ChatTemplateError::Render)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| match e.detail().and_then(|d| d.strip_prefix(RAISED)) {
                Some(msg) => ChatTemplateError::Raised(msg.to_string()),
                None => ChatTemplateError::Render(e),
            })
    }
}

/// A small `strftime` for UTC (templates use it for "today's date" lines): %Y %y %m %d
/// %e %H %I %M %S %p %j %a %A %b %B %%; other directives are copied as is.
fn strftime_utc(format: &str, unix_secs: i64) -> String {
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let year_start = days_from_civil(year, 1, 1);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[month as usize - 1];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:2}"),
            Some('H') => out += &format!("{hour:02}"),
            Some('I') => out += &format!("{:02}", (hour + 11) % 12 + 1),
            Some('M') => out += &format!("{minute:02}"),
            Some('S') => out += &format!("{second:02}"),
            Some('p') => out += if hour < 12 { "AM" } else { "PM" },
            Some('j') => out += &format!("{:03}", days - year_start + 1),
            Some('a') => out += &weekday[..3],
            Some('A') => out += weekday,
            Some('b') => out += &month_name[..3],
            Some('B') => out += month_name,
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31); Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        let out = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&[ChatMessage::new("user", "Hi")], false).unwrap();
        assert!(out.ends_with("Hi<|im_end|>\n"));
    }

    #[test]
    fn raise_exception_is_reported_as_rejection() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ bos_token }}{{ messages[0]['content'].strip() }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        match t.render(&[ChatMessage::new("assistant", "x")], false) {
            Err(ChatTemplateError::Raised(msg)) => assert_eq!(msg, "first must be user"),
            other => panic!("unexpected {other:?}"),
        }
        let out = t
            .render(&[ChatMessage::new("user", "  hi ")], false)
            .unwrap();
        assert_eq!(out, "<s>hi");
    }

    #[test]
    fn syntax_errors_are_reported() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(ChatTemplateError::Syntax(_))
        ));
    }

    #[test]
    fn strftime_formats_utc() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %a %b %j %I%p %%", t),
            "2024-02-29 13:05:09 Thu Feb 060 01PM %"
        );
        assert_eq!(strftime_utc("%d %B %Y", 0), "01 January 1970");
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }
}
