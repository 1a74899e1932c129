//! The error every command-line grammar of the load generator gives (`--load`, `--workload`,
//! `--sweep`): which grammar, the part at fault and what is wrong with it.

/// A spec that did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{grammar}: `{part}`: {problem}")]
pub struct ParseError {
    /// The grammar's name in messages (`load shape`, `workload`, `sweep`).
    pub grammar: &'static str,
    pub part: String,
    pub problem: String,
}

impl ParseError {
    pub fn new(grammar: &'static str, part: &str, problem: impl Into<String>) -> ParseError {
        ParseError {
            grammar,
            part: part.to_owned(),
            problem: problem.into(),
        }
    }
}

/// `s` as a positive, finite number; the error names `s` in `grammar`.
pub(crate) fn positive(grammar: &'static str, s: &str) -> Result<f64, ParseError> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(ParseError::new(grammar, s, "expected a positive number")),
    }
}
