//! Drawing [`Figure`]s with `plotters`, to SVG or PNG.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::{Figure, Legend, LineStyle, Panel, PlotError, PlotFormat};

/// DejaVu Sans (`data/fonts`, licence in `data/LICENSES`): plotters' `ab_glyph` text loads no
/// system font, so every label is drawn with this one, the same everywhere.
static FONT: &[u8] = include_bytes!("../../../data/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

/// Registers the bundled font, once per process.
pub(super) fn register_font() -> Result<(), PlotError> {
    static LOADED: OnceLock<bool> = OnceLock::new();
    let loaded = *LOADED
        .get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    loaded.then_some(()).ok_or(PlotError::Font)
}

/// Colour-blind-friendly categorical colours (Okabe–Ito), then black.
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(240, 228, 66),
    RGBColor(0, 0, 0),
];
const RULE: RGBColor = RGBColor(200, 0, 0);

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

pub(super) fn write(
    figure: &Figure,
    format: PlotFormat,
    path: &Path,
    size: (u32, u32),
) -> Result<(), String> {
    match format {
        PlotFormat::Svg => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            draw_figure(&root, figure)?;
            root.present().map_err(err)
        }
        PlotFormat::Png => {
            let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
            {
                let root = BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area();
                draw_figure(&root, figure)?;
                root.present().map_err(err)?;
            }
            write_png(path, &rgb, size)
        }
    }
}

/// `rgb` (8-bit RGB, row by row) as a PNG file.
fn write_png(path: &Path, rgb: &[u8], (w, h): (u32, u32)) -> Result<(), String> {
    let file = std::fs::File::create(path).map_err(err)?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(err)?;
    writer.write_image_data(rgb).map_err(err)?;
    writer.finish().map_err(err)
}

fn draw_figure<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    figure: &Figure,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let (_, h) = root.dim_in_pixel();
    let title_px = (h / 32).clamp(12, 28);
    let area = root
        .titled(&figure.title, (FAMILY, title_px))
        .map_err(err)?;
    let cells = area.split_evenly(figure.grid);
    for (panel, cell) in figure.panels.iter().zip(&cells) {
        draw_panel(cell, panel)?;
    }
    Ok(())
}

/// The range covering `values` (and 0 where `from_zero`), padded so no line sits on an edge.
fn range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    if hi <= lo {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.5 };
        return (
            lo - if from_zero && lo == 0.0 { 0.0 } else { pad },
            hi + pad,
        );
    }
    let pad = (hi - lo) * 0.05;
    hi += pad;
    if !from_zero {
        lo -= pad;
    }
    (lo, hi)
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
) -> Result<(), String> {
    let (_, h) = area.dim_in_pixel();
    let text = (h / 16).clamp(10, 18);
    let xs = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .chain(panel.v_rules.iter().map(|r| r.at));
    let ys = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(panel.h_rules.iter().map(|r| r.at));
    let x = panel.x_range.unwrap_or_else(|| range(xs, false));
    let y = match panel.y_max {
        Some(max) => (0.0, max * 1.02),
        None => range(ys, true),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.caption, (FAMILY, text + 2))
        .margin(8)
        .x_label_area_size(text * 3)
        .y_label_area_size(text * 4)
        .build_cartesian_2d(x.0..x.1, y.0..y.1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(&panel.x_label)
        .y_desc(&panel.y_label)
        .label_style((FAMILY, text))
        .axis_desc_style((FAMILY, text))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    for s in &panel.series {
        let c = color(s.color);
        let style = c.stroke_width(2);
        let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], style);
        let pts = s
            .points
            .iter()
            .copied()
            .filter(|(a, b)| a.is_finite() && b.is_finite());
        let drawn = match s.style {
            LineStyle::Marked => chart
                .draw_series(LineSeries::new(pts, style).point_size(3))
                .map_err(err)?,
            LineStyle::Plain => chart
                .draw_series(LineSeries::new(pts, style))
                .map_err(err)?,
            LineStyle::Dashed => chart
                .draw_series(DashedLineSeries::new(pts, 6, 4, c.stroke_width(1)))
                .map_err(err)?,
            LineStyle::Points => chart
                .draw_series(pts.map(|p| Circle::new(p, 5, c.filled())))
                .map_err(err)?,
        };
        // A nameless series (the second bound of a pair) stays out of the legend.
        if !s.name.is_empty() {
            drawn.label(&s.name).legend(legend);
        }
    }
    let rule = RULE.stroke_width(2);
    let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], rule);
    for r in &panel.h_rules {
        chart
            .draw_series(DashedLineSeries::new(
                [(x.0, r.at), (x.1, r.at)],
                8,
                4,
                rule,
            ))
            .map_err(err)?
            .label(&r.name)
            .legend(legend);
    }
    for r in &panel.v_rules {
        chart
            .draw_series(DashedLineSeries::new(
                [(r.at, y.0), (r.at, y.1)],
                8,
                4,
                rule,
            ))
            .map_err(err)?
            .label(&r.name)
            .legend(legend);
    }
    if !(panel.series.is_empty() && panel.h_rules.is_empty() && panel.v_rules.is_empty()) {
        chart
            .configure_series_labels()
            .position(match panel.legend {
                Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
                Legend::UpperRight => SeriesLabelPosition::UpperRight,
                Legend::LowerRight => SeriesLabelPosition::LowerRight,
            })
            .label_font((FAMILY, text))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_pad_and_start_at_zero() {
        assert_eq!(range([].into_iter(), true), (0.0, 1.0));
        assert_eq!(range([2.0, 4.0].into_iter(), true), (0.0, 4.2));
        assert_eq!(range([2.0, 4.0].into_iter(), false), (1.9, 4.1));
        // One value: a width around it.
        assert_eq!(range([4.0].into_iter(), false), (2.0, 6.0));
        assert_eq!(range([0.0].into_iter(), true), (0.0, 1.0));
        assert_eq!(range([f64::NAN, 1.0].into_iter(), true), (0.0, 1.05));
    }
}
