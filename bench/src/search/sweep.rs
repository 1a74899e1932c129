//! `--sweep`: a fixed list of loads, run in turn, instead of a search.
//!
//! Grammar: `AXIS=ITEMS[;OPTION...]`, `AXIS` one of `rate` (requests per second, open loop)
//! and `concurrency` (requests in flight, closed loop). `ITEMS` is a comma list of loads and
//! ranges, together strictly increasing: `FROM..TOxFACTOR` multiplies (`1..32x2` is 1, 2, 4,
//! 8, 16, 32) and `FROM..TO+STEP` adds (`2..8+2` is 2, 4, 6, 8); a range ends at the last
//! value not above `TO`. A rate's arrivals are Poisson unless an option says otherwise:
//! `arrivals=constant`, `arrivals=poisson` or `burstiness=K` (gamma, as in the load shapes).
//! Examples: `rate=1,2,4`, `rate=0.5..8x2;arrivals=constant`, `concurrency=1..32x2`,
//! `concurrency=1,4,16`.

use crate::grammar::{positive, ParseError};
use std::fmt;
use std::str::FromStr;

use super::Axis;
use crate::arrivals::{Arrivals, LoadShape};

/// The most loads one sweep may hold: a typo in a range should not become a day of runs.
pub const MAX_POINTS: usize = 1000;

/// A parsed `--sweep`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep {
    pub axis: Axis,
    /// Strictly increasing; whole numbers for a concurrency.
    pub loads: Vec<f64>,
    /// For a rate; Poisson unless told otherwise.
    pub arrivals: Arrivals,
}

impl Sweep {
    /// One load shape per load, in order.
    pub fn shapes(&self) -> Vec<LoadShape> {
        self.loads
            .iter()
            .filter_map(|&load| self.axis.shape(load, self.arrivals))
            .collect()
    }
}

/// This grammar's name in its errors.
const GRAMMAR: &str = "sweep";

fn bad(part: &str, problem: impl Into<String>) -> ParseError {
    ParseError::new(GRAMMAR, part, problem)
}

/// `--sweep` straight to its load shapes.
pub fn parse_sweep(s: &str) -> Result<Vec<LoadShape>, ParseError> {
    Ok(s.parse::<Sweep>()?.shapes())
}

impl FromStr for Sweep {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        let mut parts = s.trim().split(';').map(str::trim);
        let head = parts.next().unwrap_or_default();
        let (axis, items) = head
            .split_once('=')
            .ok_or_else(|| bad(head, "expected rate=LOADS or concurrency=LOADS"))?;
        let axis = match axis.trim() {
            "rate" => Axis::Rate,
            "concurrency" => Axis::Concurrency,
            other => return Err(bad(other, "unknown axis (expected rate or concurrency)")),
        };
        let mut loads = Vec::new();
        for item in items.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(bad(items, "an empty load"));
            }
            expand(item, &mut loads)?;
        }
        for pair in loads.windows(2) {
            if pair[1] <= pair[0] {
                return Err(bad(
                    items,
                    format!("loads must increase ({} then {})", pair[0], pair[1]),
                ));
            }
        }
        if axis == Axis::Concurrency {
            if let Some(x) = loads.iter().find(|x| x.fract() != 0.0 || **x < 1.0) {
                return Err(bad(
                    items,
                    format!("a concurrency is a whole number >= 1, not {x}"),
                ));
            }
        }
        let mut arrivals = None;
        for option in parts {
            if axis == Axis::Concurrency {
                return Err(bad(option, "a concurrency sweep takes no options"));
            }
            let chosen = match option.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
                Some(("arrivals", "poisson")) => Arrivals::Poisson,
                Some(("arrivals", "constant")) => Arrivals::Constant,
                Some(("arrivals", _)) => {
                    return Err(bad(
                        option,
                        "expected arrivals=poisson or arrivals=constant",
                    ))
                }
                Some(("burstiness", k)) => Arrivals::Gamma {
                    burstiness: positive(GRAMMAR, k)?,
                },
                _ => {
                    return Err(bad(
                        option,
                        "unknown option (expected arrivals= or burstiness=)",
                    ))
                }
            };
            if arrivals.replace(chosen).is_some() {
                return Err(bad(option, "the arrivals are given twice"));
            }
        }
        Ok(Sweep {
            axis,
            loads,
            arrivals: arrivals.unwrap_or(Arrivals::Poisson),
        })
    }
}

/// Appends the loads of one item: a number or a range.
fn expand(item: &str, loads: &mut Vec<f64>) -> Result<(), ParseError> {
    let Some((from, rest)) = item.split_once("..") else {
        loads.push(positive(GRAMMAR, item)?);
        return check_len(item, loads);
    };
    let from = positive(GRAMMAR, from.trim())?;
    let (to, step, multiply) = if let Some((to, f)) = rest.split_once('x') {
        (to, f, true)
    } else if let Some((to, s)) = rest.split_once('+') {
        (to, s, false)
    } else {
        return Err(bad(
            item,
            "a range needs xFACTOR or +STEP (e.g. 1..32x2, 2..8+2)",
        ));
    };
    let (to, step) = (
        positive(GRAMMAR, to.trim())?,
        positive(GRAMMAR, step.trim())?,
    );
    if to < from {
        return Err(bad(item, "the range ends below its start"));
    }
    if multiply && step <= 1.0 {
        return Err(bad(item, "the factor must be above 1"));
    }
    // Each value from its index, not by accumulating, so `0.1..1+0.1` ends at 1 not 0.99…;
    // the slack admits an end that rounding puts a hair above `to`.
    let slack = to * 1e-9;
    for i in 0.. {
        let x = if multiply {
            from * step.powi(i)
        } else {
            from + step * f64::from(i)
        };
        if x > to + slack {
            break;
        }
        loads.push(x.min(to));
        check_len(item, loads)?;
    }
    Ok(())
}

fn check_len(item: &str, loads: &[f64]) -> Result<(), ParseError> {
    if loads.len() > MAX_POINTS {
        return Err(bad(item, format!("more than {MAX_POINTS} loads")));
    }
    Ok(())
}

/// Writes the sweep back as a list, so a report can name it and the name parses again.
impl fmt::Display for Sweep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let axis = match self.axis {
            Axis::Rate => "rate",
            Axis::Concurrency => "concurrency",
        };
        let loads: Vec<String> = self.loads.iter().map(f64::to_string).collect();
        write!(f, "{axis}={}", loads.join(","))?;
        match (self.axis, self.arrivals) {
            (Axis::Rate, Arrivals::Constant) => write!(f, ";arrivals=constant"),
            (Axis::Rate, Arrivals::Gamma { burstiness }) => write!(f, ";burstiness={burstiness}"),
            _ => Ok(()),
        }
    }
}
