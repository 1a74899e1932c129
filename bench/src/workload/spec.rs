//! The workload grammar: [`WorkloadSpec`]'s `FromStr` and its `Display` (which parses back to
//! the same spec, so a report names its workload in a form that can be rerun).

use crate::grammar::{positive, ParseError};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::trace::TRACE_BLOCK_TOKENS;

/// Where a workload's requests come from (the grammar: [`crate::workload`]).
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadSpec {
    /// Prompts of drawn lengths and no content of note.
    Synthetic(SyntheticSpec),
    /// One JSON object per line: `{"prompt": ...}` or `{"messages": [...]}`.
    Jsonl(PathBuf),
    /// A ShareGPT JSON file.
    ShareGpt(PathBuf),
    /// The Mooncake FAST'25 trace (the bundled one without a path).
    Mooncake {
        path: Option<PathBuf>,
        /// Lengths are divided by this; it divides 512.
        scale: u32,
        /// Whole multi-turn conversations spread over the trace
        /// ([`crate::trace::sample_conversations`]) instead of its first requests.
        conversations: Option<usize>,
    },
    /// The Azure LLM inference 2023 conversation trace (the bundled one without a path).
    Azure {
        path: Option<PathBuf>,
        /// Lengths are divided by this (rounded up).
        scale: f64,
    },
}

/// Mooncake's default scale: 512-token blocks of 32 tokens, prompts that fit a small model.
pub const DEFAULT_MOONCAKE_SCALE: u32 = 16;

/// `synthetic:` lengths.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// Prompt tokens after the shared prefix.
    pub input: Length,
    pub output: Length,
    /// A prefix of this many tokens shared by every prompt (a system prompt).
    pub prefix: Option<u32>,
    /// Trace-drawn ([`Length::Azure`]) lengths are divided by this (rounded up).
    pub scale: Option<f64>,
    /// Caps on drawn lengths (after `scale`).
    pub max_input: Option<u32>,
    pub max_output: Option<u32>,
}

/// A distribution of lengths in tokens; every draw is at least 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Length {
    Fixed(u32),
    /// Uniform over the whole numbers `min..=max`.
    Uniform {
        min: u32,
        max: u32,
    },
    /// Normal, rounded, clipped to at least 1.
    Normal {
        mean: f64,
        sd: f64,
    },
    /// Drawn from the Azure conversation trace; input and output both `azure` are drawn as
    /// one request's pair.
    Azure,
}

/// This grammar's name in its errors.
const GRAMMAR: &str = "workload";

fn bad(part: &str, problem: impl Into<String>) -> ParseError {
    ParseError::new(GRAMMAR, part, problem)
}

const KINDS: &str = "synthetic, jsonl, sharegpt, mooncake, azure";

impl FromStr for WorkloadSpec {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        // The kind ends at the first `:` (a path or parameters follow) or `,` (parameters).
        let end = s.find([':', ',']).unwrap_or(s.len());
        let kind = &s[..end];
        let rest = s.get(end + 1..).unwrap_or("").trim();
        let with_path = s[end..].starts_with(':');
        match kind.trim() {
            "synthetic" => synthetic(rest).map(WorkloadSpec::Synthetic),
            "jsonl" | "sharegpt" => {
                if rest.is_empty() || !with_path {
                    return Err(bad(s, format!("expected {kind}:PATH")));
                }
                let path = PathBuf::from(rest);
                Ok(if kind == "jsonl" {
                    WorkloadSpec::Jsonl(path)
                } else {
                    WorkloadSpec::ShareGpt(path)
                })
            }
            "mooncake" => {
                let (path, params) = path_and_params(rest, with_path, &["scale", "conversations"]);
                let kv = keys(params, &["scale", "conversations"])?;
                let scale = match kv[0] {
                    None => DEFAULT_MOONCAKE_SCALE,
                    Some(v) => {
                        let scale = whole(v)?;
                        if !TRACE_BLOCK_TOKENS.is_multiple_of(scale) {
                            return Err(bad(
                                v,
                                format!(
                                    "the scale must divide {TRACE_BLOCK_TOKENS} (1, 2, 4, ... 512)"
                                ),
                            ));
                        }
                        scale
                    }
                };
                let conversations = kv[1].map(whole).transpose()?.map(|n| n as usize);
                Ok(WorkloadSpec::Mooncake {
                    path,
                    scale,
                    conversations,
                })
            }
            "azure" => {
                let (path, params) = path_and_params(rest, with_path, &["scale"]);
                let kv = keys(params, &["scale"])?;
                let scale = kv[0]
                    .map(|v| positive(GRAMMAR, v))
                    .transpose()?
                    .unwrap_or(1.0);
                Ok(WorkloadSpec::Azure { path, scale })
            }
            _ => Err(bad(
                kind,
                format!("unknown source (expected one of {KINDS})"),
            )),
        }
    }
}

fn synthetic(params: &str) -> Result<SyntheticSpec, ParseError> {
    const KEYS: [&str; 6] = [
        "input",
        "output",
        "prefix",
        "scale",
        "max_input",
        "max_output",
    ];
    let kv = keys(params, &KEYS)?;
    let length = |i: usize| -> Result<Length, ParseError> {
        kv[i]
            .ok_or_else(|| bad(params, format!("missing {}=", KEYS[i])))
            .and_then(Length::parse)
    };
    let (input, output) = (length(0)?, length(1)?);
    let spec = SyntheticSpec {
        input,
        output,
        prefix: kv[2].map(whole).transpose()?,
        scale: kv[3].map(|v| positive(GRAMMAR, v)).transpose()?,
        max_input: kv[4].map(whole).transpose()?,
        max_output: kv[5].map(whole).transpose()?,
    };
    if spec.scale.is_some() && input != Length::Azure && output != Length::Azure {
        return Err(bad(
            kv[3].unwrap_or_default(),
            "scale applies to azure lengths, and neither length is azure",
        ));
    }
    Ok(spec)
}

impl Length {
    fn parse(s: &str) -> Result<Length, ParseError> {
        let s = s.trim();
        if s == "azure" {
            return Ok(Length::Azure);
        }
        if let Some((name, args)) = s.strip_suffix(')').and_then(|s| s.split_once('(')) {
            let (a, b) = args
                .split_once(',')
                .map(|(a, b)| (a.trim(), b.trim()))
                .ok_or_else(|| bad(s, format!("expected {}(A,B)", name.trim())))?;
            return match name.trim() {
                "uniform" => {
                    let (min, max) = (whole(a)?, whole(b)?);
                    if min > max {
                        return Err(bad(s, "the minimum is above the maximum"));
                    }
                    Ok(Length::Uniform { min, max })
                }
                "normal" => {
                    let mean = positive(GRAMMAR, a)?;
                    let sd = b
                        .parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite() && *x >= 0.0)
                        .ok_or_else(|| bad(b, "expected a non-negative standard deviation"))?;
                    Ok(Length::Normal { mean, sd })
                }
                other => Err(bad(
                    other,
                    "unknown distribution (expected uniform(A,B), normal(MEAN,SD))",
                )),
            };
        }
        whole(s).map(Length::Fixed).map_err(|_| {
            bad(
                s,
                "expected a length: N, uniform(A,B), normal(MEAN,SD) or azure",
            )
        })
    }
}

/// Splits `PATH,key=v,...` (after `kind:`) into the path and the parameters. The path is the
/// first item unless it is one of `known` keys, so a path holding a comma cannot be named.
fn path_and_params<'a>(
    rest: &'a str,
    with_path: bool,
    known: &[&str],
) -> (Option<PathBuf>, &'a str) {
    let (first, params) = rest.split_once(',').unwrap_or((rest, ""));
    let is_key = first
        .split_once('=')
        .is_some_and(|(k, _)| known.contains(&k.trim()));
    if !with_path || is_key || first.trim().is_empty() {
        return (None, rest);
    }
    (Some(PathBuf::from(first.trim())), params)
}

/// Splits at commas outside parentheses (`uniform(64,512)` is one value).
fn top_level_items(params: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in params.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&params[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&params[start..]);
    items
        .into_iter()
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .collect()
}

/// The values of `allowed` keys in `key=value,...`, refusing unknown and repeated ones.
fn keys<'a>(params: &'a str, allowed: &[&str]) -> Result<Vec<Option<&'a str>>, ParseError> {
    let mut values = vec![None; allowed.len()];
    for item in top_level_items(params) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| bad(item, "expected key=value"))?;
        let i = allowed.iter().position(|a| *a == k.trim()).ok_or_else(|| {
            bad(
                item,
                format!("unknown key (expected {})", allowed.join(", ")),
            )
        })?;
        if values[i].replace(v.trim()).is_some() {
            return Err(bad(item, "given twice"));
        }
    }
    Ok(values)
}

fn whole(s: &str) -> Result<u32, ParseError> {
    match s.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad(s, "expected a whole number, at least 1")),
    }
}

impl fmt::Display for Length {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Length::Fixed(n) => write!(f, "{n}"),
            Length::Uniform { min, max } => write!(f, "uniform({min},{max})"),
            Length::Normal { mean, sd } => write!(f, "normal({mean},{sd})"),
            Length::Azure => write!(f, "azure"),
        }
    }
}

impl fmt::Display for WorkloadSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkloadSpec::Synthetic(s) => {
                write!(f, "synthetic:input={},output={}", s.input, s.output)?;
                let extras = [
                    ("prefix", s.prefix.map(|n| n.to_string())),
                    ("scale", s.scale.map(|x| x.to_string())),
                    ("max_input", s.max_input.map(|n| n.to_string())),
                    ("max_output", s.max_output.map(|n| n.to_string())),
                ];
                for (k, v) in extras {
                    if let Some(v) = v {
                        write!(f, ",{k}={v}")?;
                    }
                }
                Ok(())
            }
            WorkloadSpec::Jsonl(path) => write!(f, "jsonl:{}", path.display()),
            WorkloadSpec::ShareGpt(path) => write!(f, "sharegpt:{}", path.display()),
            WorkloadSpec::Mooncake {
                path,
                scale,
                conversations,
            } => {
                write!(f, "mooncake")?;
                if let Some(path) = path {
                    write!(f, ":{}", path.display())?;
                }
                write!(f, ",scale={scale}")?;
                if let Some(n) = conversations {
                    write!(f, ",conversations={n}")?;
                }
                Ok(())
            }
            WorkloadSpec::Azure { path, scale } => {
                write!(f, "azure")?;
                if let Some(path) = path {
                    write!(f, ":{}", path.display())?;
                }
                if *scale != 1.0 {
                    write!(f, ",scale={scale}")?;
                }
                Ok(())
            }
        }
    }
}
