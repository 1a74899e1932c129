//! `--slo ttft=500ms,itl=50ms,e2e=10s`: the objectives a request must meet.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use humantime_serde::re::humantime;
use serde::{Deserialize, Serialize};

/// One latency objective. Each is judged on one statistic of one request (per-request
/// semantics, as vLLM's `--goodput` and aiperf's goodput judge them); see [`Self::NAMES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Time to first token: from the send to the first token.
    Ttft,
    /// Inter-token latency, judged on the request's *longest* gap between two tokens: the
    /// objective holds when every gap does. The mean gap is [`Objective::Tpot`] already, and
    /// the p99 of one request's few dozen gaps is only an interpolation next to its maximum;
    /// the longest gap is the stall a reader of the stream sees. Met with fewer than two
    /// tokens (no gap).
    Itl,
    /// Time per output token after the first: `(e2e - ttft) / (output_tokens - 1)`, vLLM's
    /// `tpot` and aiperf's per-request `inter_token_latency` (use `tpot=` for goodput
    /// comparable with theirs). Met with fewer than two tokens, as in vLLM.
    Tpot,
    /// End to end: from the send to the end of the stream.
    E2e,
}

impl Objective {
    /// How many there are.
    pub const COUNT: usize = 4;
    /// The names `--slo` accepts, in this order.
    pub const NAMES: [&'static str; Self::COUNT] = ["ttft", "itl", "tpot", "e2e"];
    pub const ALL: [Objective; Self::COUNT] = [
        Objective::Ttft,
        Objective::Itl,
        Objective::Tpot,
        Objective::E2e,
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl fmt::Display for Objective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Objective {
    type Err = SloSpecError;

    fn from_str(s: &str) -> Result<Objective, SloSpecError> {
        Self::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| SloSpecError::UnknownObjective(s.to_owned()))
    }
}

/// Why a `--slo` value did not parse; each names the part at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SloSpecError {
    #[error("empty SLO: expected objectives such as `ttft=500ms,itl=50ms`")]
    Empty,
    #[error("`{0}`: expected `name=duration`, such as `ttft=500ms`")]
    NotAPair(String),
    #[error("unknown objective `{0}`: expected one of ttft, itl, tpot, e2e")]
    UnknownObjective(String),
    #[error("objective `{0}` given twice")]
    Duplicate(Objective),
    #[error("`{objective}={value}`: bad duration: {reason}")]
    BadDuration {
        objective: Objective,
        value: String,
        reason: String,
    },
}

/// The objectives of a run: each objective at most once, with its target (a request meets
/// it when its statistic is at most the target).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SloSpec {
    targets: BTreeMap<Objective, Duration>,
}

impl SloSpec {
    /// The objectives with their targets, in [`Objective`] order.
    pub fn targets(&self) -> impl Iterator<Item = (Objective, Duration)> + '_ {
        self.targets.iter().map(|(&o, &t)| (o, t))
    }
}

impl FromStr for SloSpec {
    type Err = SloSpecError;

    fn from_str(s: &str) -> Result<SloSpec, SloSpecError> {
        if s.trim().is_empty() {
            return Err(SloSpecError::Empty);
        }
        let mut targets = BTreeMap::new();
        for part in s.split(',').map(str::trim) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| SloSpecError::NotAPair(part.to_owned()))?;
            let objective: Objective = name.trim().parse()?;
            let value = value.trim();
            let target =
                humantime::parse_duration(value).map_err(|e| SloSpecError::BadDuration {
                    objective,
                    value: value.to_owned(),
                    reason: e.to_string(),
                })?;
            if targets.insert(objective, target).is_some() {
                return Err(SloSpecError::Duplicate(objective));
            }
        }
        Ok(SloSpec { targets })
    }
}

/// The `--slo` form, which parses back to the same spec.
impl fmt::Display for SloSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (objective, target)) in self.targets().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{objective}={}", humantime::format_duration(target))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> SloSpecError {
        s.parse::<SloSpec>().unwrap_err()
    }

    #[test]
    fn parses_every_objective_in_humantime() {
        let spec: SloSpec = "e2e=10s, ttft=500ms,tpot=20ms,itl=1m".parse().unwrap();
        let targets: Vec<_> = spec.targets().collect();
        assert_eq!(
            targets,
            [
                (Objective::Ttft, Duration::from_millis(500)),
                (Objective::Itl, Duration::from_secs(60)),
                (Objective::Tpot, Duration::from_millis(20)),
                (Objective::E2e, Duration::from_secs(10)),
            ]
        );
        assert_eq!(spec.to_string(), "ttft=500ms,itl=1m,tpot=20ms,e2e=10s");
        assert_eq!(spec.to_string().parse::<SloSpec>().unwrap(), spec);
    }

    #[test]
    fn errors_name_the_bad_part() {
        assert_eq!(err(""), SloSpecError::Empty);
        assert_eq!(err("  "), SloSpecError::Empty);
        assert_eq!(
            err("ttft=1s,e2el=3s"),
            SloSpecError::UnknownObjective("e2el".into())
        );
        assert_eq!(
            err("ttft=1s,ttft=2s"),
            SloSpecError::Duplicate(Objective::Ttft)
        );
        assert_eq!(err("ttft=1s,"), SloSpecError::NotAPair(String::new()));
        assert_eq!(err("ttft"), SloSpecError::NotAPair("ttft".into()));
        let bad = err("itl=50 parsecs");
        assert!(
            matches!(&bad, SloSpecError::BadDuration { objective: Objective::Itl, value, .. } if value == "50 parsecs"),
            "{bad:?}"
        );
        assert!(bad
            .to_string()
            .starts_with("`itl=50 parsecs`: bad duration: "));
        assert!(err("ttft=")
            .to_string()
            .starts_with("`ttft=`: bad duration"));
        assert_eq!(
            err("foo=1s").to_string(),
            "unknown objective `foo`: expected one of ttft, itl, tpot, e2e"
        );
    }
}
