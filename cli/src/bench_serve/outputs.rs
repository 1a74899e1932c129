//! Where `kvmesh bench serve` writes: report.json, requests.csv (one line per request, its
//! point's label first) and the plots, all in one directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use kvmesh_bench::load::csv;
use kvmesh_bench::plot::{self, PlotFormat};
use kvmesh_bench::probe::Measured;
use kvmesh_bench::report::BenchReport;
use kvmesh_bench::search::{Found, Stop};

/// `--out`, or `target/<command>/<UTC timestamp>` (one directory per run, never overwritten
/// by the next).
pub fn out_dir(out: Option<&Path>, command: &str) -> PathBuf {
    out.map_or_else(
        || {
            let now = time::OffsetDateTime::now_utc();
            PathBuf::from("target").join(command).join(format!(
                "{:04}{:02}{:02}-{:02}{:02}{:02}",
                now.year(),
                u8::from(now.month()),
                now.day(),
                now.hour(),
                now.minute(),
                now.second()
            ))
        },
        Path::to_owned,
    )
}

/// Writes everything into `dir` (created if missing); the paths written, for the user.
pub fn write(
    dir: &Path,
    report: &BenchReport,
    measured: &[Measured],
    formats: &[PlotFormat],
) -> Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = dir.join("report.json");
    std::fs::write(&json, report.to_json() + "\n")
        .with_context(|| format!("writing {}", json.display()))?;
    let requests = dir.join("requests.csv");
    std::fs::write(&requests, requests_csv(measured))
        .with_context(|| format!("writing {}", requests.display()))?;
    let mut written = vec![json.display().to_string(), requests.display().to_string()];
    if !formats.is_empty() {
        let plots = plot::write_plots(dir, report, formats, plot::DEFAULT_SIZE)
            .context("drawing the plots")?;
        written.push(format!("{} plots in {}", plots.len(), dir.display()));
    }
    Ok(written)
}

/// Every request of every point, in the order sent, labelled with its point.
fn requests_csv(measured: &[Measured]) -> String {
    let mut out = csv::header("point");
    out.push('\n');
    for m in measured {
        for outcome in &m.run.outcomes {
            csv::push_row(&mut out, &m.point.label, outcome, outcome.gaps.len());
            out.push('\n');
        }
    }
    out
}

/// A report written by `kvmesh bench serve`, or an error naming the file.
pub fn read_report(path: &Path) -> Result<BenchReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    BenchReport::from_json(&text).with_context(|| format!("{}", path.display()))
}

/// What a max-goodput search ended on, for the user.
pub fn search_note(found: Option<Found>) -> String {
    let Some(f) = found else {
        return "max goodput: the start load failed the SLO: no load found (try a lower \
                --search-start or a looser --slo)"
            .into();
    };
    let why = match f.stop {
        Stop::Resolved => "pass and fail within the resolution",
        Stop::ReachedMax => "--search-max passed: the limit, if any, is above it",
        Stop::ProbeLimit => "--search-max-probes ran out",
        Stop::FailsAtStart => "the start failed",
    };
    let above = f
        .lowest_fail
        .map_or(String::new(), |l| format!(", lowest fail {l}"));
    format!(
        "max goodput search: highest pass {}{above} after {} probes ({why})",
        f.load, f.probes
    )
}
