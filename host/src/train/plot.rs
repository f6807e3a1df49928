//! Training curves as PNG and SVG (plotters): one figure of small panels
//! (reward, entropy, held-out accuracy, silenced-token ratio, response length)
//! with one line per run, so runs of several objectives compare at a glance.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::util::read_jsonl;
use crate::{Error, Result};

/// DejaVu Sans (Bitstream Vera license), embedded so plots render without system fonts.
const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// One line of a panel.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One small chart.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

/// The metrics files of one run.
#[derive(Debug, Clone)]
pub struct RunCurves {
    pub label: String,
    /// `metrics.jsonl` (one JSON object per step).
    pub metrics: PathBuf,
    /// `eval.jsonl` (step, overall.avg), if the run evaluated.
    pub eval: Option<PathBuf>,
}

fn register_font() {
    // Registering twice is harmless; plotters keeps the last one.
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
}

fn series(label: &str, rows: &[serde_json::Value], x: &str, y: &[&str]) -> Series {
    let get = |v: &serde_json::Value| y.iter().try_fold(v, |v, k| v.get(k)).and_then(|v| v.as_f64());
    Series {
        label: label.to_string(),
        points: rows.iter().filter_map(|r| Some((r.get(x)?.as_f64()?, get(r)?))).collect(),
    }
}

/// The standard panels for a set of runs.
pub fn standard_panels(runs: &[RunCurves]) -> Result<Vec<Panel>> {
    let mut panels: Vec<Panel> = [
        "reward (mean)",
        "entropy (nats/token)",
        "held-out accuracy (avg@n)",
        "silenced-token ratio",
        "response length (tokens)",
    ]
    .iter()
    .map(|t| Panel { title: t.to_string(), series: Vec::new() })
    .collect();
    for r in runs {
        let m: Vec<serde_json::Value> = read_jsonl(&r.metrics)?;
        panels[0].series.push(series(&r.label, &m, "step", &["reward_mean"]));
        panels[1].series.push(series(&r.label, &m, "step", &["entropy"]));
        if let Some(e) = &r.eval {
            if e.is_file() {
                let rows: Vec<serde_json::Value> = read_jsonl(e)?;
                panels[2].series.push(series(&r.label, &rows, "step", &["overall", "avg"]));
            }
        }
        panels[3].series.push(series(&r.label, &m, "step", &["silenced_ratio"]));
        panels[4].series.push(series(&r.label, &m, "step", &["response_len_mean"]));
    }
    Ok(panels)
}

/// Draws `panels` in a grid into `<stem>.png` and `<stem>.svg`.
pub fn plot(panels: &[Panel], stem: &Path) -> Result<(PathBuf, PathBuf)> {
    register_font();
    let png = stem.with_extension("png");
    let svg = stem.with_extension("svg");
    let cols = 3usize;
    let rows = panels.len().div_ceil(cols).max(1);
    let size = (420 * cols as u32, 300 * rows as u32);
    draw(BitMapBackend::new(&png, size).into_drawing_area(), panels, cols, rows)
        .map_err(|e| Error::invalid(format!("{}: {e}", png.display())))?;
    draw(SVGBackend::new(&svg, size).into_drawing_area(), panels, cols, rows)
        .map_err(|e| Error::invalid(format!("{}: {e}", svg.display())))?;
    Ok((png, svg))
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    panels: &[Panel],
    cols: usize,
    rows: usize,
) -> std::result::Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((rows, cols));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let pts = panel.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in pts {
            if x.is_finite() && y.is_finite() {
                x0 = x0.min(x);
                x1 = x1.max(x);
                y0 = y0.min(y);
                y1 = y1.max(y);
            }
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 - x0 < 1e-9 {
            x1 = x0 + 1.0;
        }
        let pad = ((y1 - y0) * 0.08).max(y1.abs().max(y0.abs()) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(48)
            .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| tick(*y))
            .label_style(("sans-serif", 11))
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, s) in panel.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(s.label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            // Sparse series (evaluations) get markers so single points show.
            if s.points.len() <= 30 {
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
        }
        // One run needs no legend; several get one in the corner.
        if panel.series.len() > 1 {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .label_font(("sans-serif", 11))
                .draw()
                .map_err(|e| e.to_string())?;
        }
    }
    root.present().map_err(|e| e.to_string())
}

/// A y-axis tick: fixed decimals for ordinary values, scientific for tiny ones.
fn tick(y: f64) -> String {
    let a = y.abs();
    if a == 0.0 || a < 1e-12 {
        "0".into()
    } else if a < 1e-2 {
        format!("{y:.1e}")
    } else if a < 10.0 {
        format!("{y:.3}")
    } else {
        format!("{y:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_png_and_svg_with_every_series() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("metrics.jsonl");
        let lines: String = (0..5)
            .map(|s| format!("{{\"step\":{s},\"reward_mean\":{},\"entropy\":1.5,\"silenced_ratio\":0.001,\"response_len_mean\":20}}\n", s as f64 / 10.0))
            .collect();
        std::fs::write(&m, lines).unwrap();
        let panels = standard_panels(&[
            RunCurves { label: "stapo".into(), metrics: m.clone(), eval: None },
            RunCurves { label: "grpo".into(), metrics: m, eval: None },
        ])
        .unwrap();
        assert_eq!(panels[0].series.len(), 2);
        assert_eq!(panels[0].series[0].points.len(), 5);
        assert_eq!(panels[0].series[0].points[4], (4.0, 0.4));
        let (png, svg) = plot(&panels, &dir.path().join("curves")).unwrap();
        let png_bytes = std::fs::read(&png).unwrap();
        assert_eq!(&png_bytes[..4], b"\x89PNG");
        let svg_text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            svg_text.contains("reward (mean)") && svg_text.contains("stapo") && svg_text.contains("grpo")
        );
    }

    #[test]
    fn bad_metrics_line_is_reported_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("metrics.jsonl");
        std::fs::write(&m, "{\"step\":0}\nnot json\n").unwrap();
        let err = standard_panels(&[RunCurves { label: "x".into(), metrics: m, eval: None }])
            .unwrap_err()
            .to_string();
        assert!(err.contains("metrics.jsonl:2"), "{err}");
    }
}
