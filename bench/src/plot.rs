//! Plots of a [`BenchReport`], drawn from the report alone (so from its JSON too): latency
//! percentiles and goodput against load with the SLO's targets, latency CDFs per load level,
//! and each level's timeline. SVG and PNG, with a bundled font (DejaVu Sans), so text renders
//! the same on a machine with no fonts installed.
//!
//! [`figures`] lays out what to draw as data ([`Figure`]s of [`Panel`]s of [`Series`]);
//! [`write_plots`] draws them with `plotters`.

mod charts;
mod draw;
mod pareto;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use charts::figures;
pub use pareto::{pareto_figure, write_pareto, TradeOff};

use crate::report::BenchReport;

/// A file format of the plots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlotFormat {
    Svg,
    Png,
}

impl PlotFormat {
    pub fn extension(self) -> &'static str {
        match self {
            PlotFormat::Svg => "svg",
            PlotFormat::Png => "png",
        }
    }
}

impl fmt::Display for PlotFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.extension())
    }
}

impl FromStr for PlotFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<PlotFormat, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "svg" => Ok(PlotFormat::Svg),
            "png" => Ok(PlotFormat::Png),
            _ => Err(format!("unknown plot format `{s}`: expected svg or png")),
        }
    }
}

/// Width and height of every plot, in pixels, unless asked otherwise.
pub const DEFAULT_SIZE: (u32, u32) = (1280, 800);

/// Why plots were not written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: drawing failed: {message}")]
    Draw { path: PathBuf, message: String },
    #[error("plot size {0}x{1}: each side must be between 64 and 16384 pixels")]
    Size(u32, u32),
    #[error("the bundled font does not load")]
    Font,
}

/// A line of a panel.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The legend's name for it; empty: none (the second line of a pair of bounds).
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// A palette index ([`draw`]'s colours, cycling).
    pub color: usize,
    pub style: LineStyle,
}

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineStyle {
    /// A line with a mark at each point (few points: load levels).
    Marked,
    /// A plain line (many points: CDFs, timelines).
    Plain,
    /// Dashed (bounds, a shape's nominal rate).
    Dashed,
    /// Marks alone (a scatter: configurations, not a series of loads).
    Points,
}

/// A reference line across a panel: an SLO target.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub name: String,
    /// Where it crosses its axis, in the panel's units.
    pub at: f64,
}

/// Where a panel's legend goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Legend {
    UpperLeft,
    UpperRight,
    LowerRight,
}

/// One chart: axes with units, lines, SLO rules and a legend.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub caption: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Horizontal rules (`y = at`).
    pub h_rules: Vec<Rule>,
    /// Vertical rules (`x = at`).
    pub v_rules: Vec<Rule>,
    /// The x axis' span where fixed (a timeline's: the whole run, in every panel alike);
    /// `None`: the data's.
    pub x_range: Option<(f64, f64)>,
    /// The y axis starts at 0 (counts, rates, latencies); a CDF's also ends at 1.
    pub y_max: Option<f64>,
    pub legend: Legend,
}

/// One file: panels in a grid under a title.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// The file's name without its extension.
    pub name: String,
    pub title: String,
    /// Rows and columns of the grid, filled row by row.
    pub grid: (usize, usize),
    pub panels: Vec<Panel>,
}

/// Draws every figure of `report` into `dir` (created if missing), once per format, each
/// `size` pixels (width, height); returns the files written, in order.
pub fn write_plots(
    dir: &Path,
    report: &BenchReport,
    formats: &[PlotFormat],
    size: (u32, u32),
) -> Result<Vec<PathBuf>, PlotError> {
    write_figures(dir, &figures(report), formats, size)
}

/// Draws `figures` into `dir` (created if missing), once per format; the files written.
pub(crate) fn write_figures(
    dir: &Path,
    figures: &[Figure],
    formats: &[PlotFormat],
    size: (u32, u32),
) -> Result<Vec<PathBuf>, PlotError> {
    let (w, h) = size;
    if !(64..=16384).contains(&w) || !(64..=16384).contains(&h) {
        return Err(PlotError::Size(w, h));
    }
    draw::register_font()?;
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Io {
        path: dir.to_owned(),
        source,
    })?;
    let mut written = Vec::new();
    for figure in figures {
        for &format in formats {
            let path = dir.join(format!("{}.{}", figure.name, format.extension()));
            draw::write(figure, format, &path, size).map_err(|message| PlotError::Draw {
                path: path.clone(),
                message,
            })?;
            written.push(path);
        }
    }
    Ok(written)
}
