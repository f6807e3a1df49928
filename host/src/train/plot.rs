//! Training curves as PNG and SVG (plotters): one figure of small panels
//! (reward, entropy, held-out accuracy, silenced-token ratio, response length, and the
//! STAPO paper's own figure: silenced tokens per 10^4 on a log scale beside the S2T
//! candidates per mini-batch)
//! with one line per run, so runs of several objectives compare at a glance;
//! the same panels over groups of seeds as mean ± spread bands; and STAPO's
//! token scatter (`spurious.png`: p against H, coloured by logit-gradient norm,
//! with the S2T region).

use std::path::{Path, PathBuf};

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::files::read_jsonl;
use crate::train::spurious::{Region, TokenPoint};
use crate::{Error, Result};

/// DejaVu Sans (Bitstream Vera license), embedded so plots render without system fonts.
const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// One line of a panel.
#[derive(Debug, Clone)]
pub struct Series {
    /// The legend's name of the line.
    pub label: String,
    /// `(x, y)` points in order of x.
    pub points: Vec<(f64, f64)>,
}

/// One small chart.
#[derive(Debug, Clone)]
pub struct Panel {
    /// The panel's title.
    pub title: String,
    /// The lines drawn.
    pub series: Vec<Series>,
    /// A log-10 y axis: points `y <= 0` are left out (a step that silenced nothing).
    pub log_y: bool,
}

/// The metrics files of one run.
#[derive(Debug, Clone)]
pub struct RunCurves {
    /// The run's name in legends.
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
        ("reward (mean)", false),
        ("entropy (nats/token)", false),
        ("held-out accuracy (avg@n)", false),
        ("silenced-token ratio", false),
        ("response length (tokens)", false),
        ("silenced tokens per 10^4 (log; 0 not drawn)", true),
        ("S2T candidates per mini-batch", false),
    ]
    .iter()
    .map(|&(t, log_y)| Panel { title: t.to_string(), series: Vec::new(), log_y })
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
        panels[5].series.push(series(&r.label, &m, "step", &["silenced_per_10k"]));
        panels[6].series.push(series(&r.label, &m, "step", &["candidates_per_mini_batch"]));
    }
    Ok(panels)
}

/// Draws `panels` in a grid into `<stem>.png` and `<stem>.svg`.
pub fn plot(panels: &[Panel], stem: &Path) -> Result<(PathBuf, PathBuf)> {
    render(&Grid { panels, cell: (420, 300) }, stem)
}

/// A figure drawn alike onto the PNG and the SVG backend.
trait Figure {
    /// Width and height in pixels.
    fn size(&self) -> (u32, u32);
    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> std::result::Result<(), String>;
}

/// Draws `fig` into `<stem>.png` and `<stem>.svg`.
fn render(fig: &impl Figure, stem: &Path) -> Result<(PathBuf, PathBuf)> {
    register_font();
    let png = stem.with_extension("png");
    let svg = stem.with_extension("svg");
    fig.draw(BitMapBackend::new(&png, fig.size()).into_drawing_area())
        .map_err(|e| Error::invalid(format!("{}: {e}", png.display())))?;
    fig.draw(SVGBackend::new(&svg, fig.size()).into_drawing_area())
        .map_err(|e| Error::invalid(format!("{}: {e}", svg.display())))?;
    Ok((png, svg))
}

/// One small chart of a [`Grid`].
trait GridPanel {
    fn draw_on<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> std::result::Result<(), String>;
}

/// Panels in a grid of three columns (fewer for one or two panels), each `cell` pixels.
struct Grid<'a, P> {
    panels: &'a [P],
    cell: (u32, u32),
}

impl<P: GridPanel> Grid<'_, P> {
    const COLS: usize = 3;

    fn cols(&self) -> usize {
        self.panels.len().clamp(1, Self::COLS)
    }

    fn rows(&self) -> usize {
        self.panels.len().div_ceil(self.cols()).max(1)
    }
}

impl<P: GridPanel> Figure for Grid<'_, P> {
    fn size(&self) -> (u32, u32) {
        (self.cell.0 * self.cols() as u32, self.cell.1 * self.rows() as u32)
    }

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((self.rows(), self.cols()));
        for (panel, area) in self.panels.iter().zip(areas.iter()) {
            panel.draw_on(area)?;
        }
        root.present().map_err(|e| e.to_string())
    }
}

/// A panel's chart: x the step, y linear.
type StepChart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// `(x0, x1, y0, y1)` spanning the finite `(x, y_lo, y_hi)` points: the unit
/// square when there are none, and at least one step wide.
fn bounds(points: impl Iterator<Item = (f64, f64, f64)>) -> (f64, f64, f64, f64) {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, lo, hi) in points {
        if x.is_finite() && lo.is_finite() && hi.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(lo);
            y1 = y1.max(hi);
        }
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    (x0, x1, y0, y1)
}

/// A panel's chart on `area` with its caption and mesh: over the [`bounds`] of
/// `points`, y padded by 8% of its span (at least 5% of its magnitude and
/// `min_pad`), with `y_label` pixels for the y labels.
fn step_chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    title: &str,
    points: impl Iterator<Item = (f64, f64, f64)>,
    (y_label, min_pad): (u32, f64),
    log_y: bool,
) -> std::result::Result<StepChart<'a, DB>, String> {
    let (x0, x1, y0, y1) = bounds(points);
    let pad = ((y1 - y0) * 0.08).max(y1.abs().max(y0.abs()) * 0.05).max(min_pad);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(28)
        .y_label_area_size(y_label)
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        // Steps are whole numbers: at most one tick per step (a single point's
        // axis 0..1 reads 0, 1, not 0, 0, ..., 1).
        .x_labels(((x1 - x0).round() as usize + 1).clamp(2, 10))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| if log_y { tick(10f64.powf(*y)) } else { tick(*y) })
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(chart)
}

/// A line through `points` with its legend entry, and markers when there are
/// few points (evaluations), so that single points show.
fn line<DB: DrawingBackend>(
    chart: &mut StepChart<'_, DB>,
    points: &[(f64, f64)],
    color: RGBAColor,
    label: String,
) -> std::result::Result<(), String> {
    chart
        .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
        .map_err(|e| e.to_string())?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    if points.len() <= 30 {
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The legend box at `pos`, on a white background of opacity `bg`, labels in `font` px.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    pos: SeriesLabelPosition,
    bg: f64,
    font: u32,
) -> std::result::Result<(), String> {
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(bg))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", font))
        .draw()
        .map_err(|e| e.to_string())
}

impl GridPanel for Panel {
    fn draw_on<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        // A log panel draws log10(y) on a linear axis whose ticks read as y, at least half a
        // decade either side; a step with y <= 0 breaks its line (no segment across it).
        let shown: Vec<Vec<Vec<(f64, f64)>>> = self.series.iter().map(|s| self.segments(&s.points)).collect();
        let points = shown.iter().flatten().flat_map(|seg| seg.iter().map(|&(x, y)| (x, y, y)));
        let min_pad = if self.log_y { 0.5 } else { 1e-3 };
        let mut chart = step_chart(area, &self.title, points, (48, min_pad), self.log_y)?;
        for (i, (s, segs)) in self.series.iter().zip(&shown).enumerate() {
            let color = Palette99::pick(i).to_rgba();
            for (k, seg) in segs.iter().enumerate() {
                if k == 0 {
                    line(&mut chart, seg, color, s.label.clone())?;
                } else {
                    chart
                        .draw_series(LineSeries::new(seg.iter().copied(), color.stroke_width(2)))
                        .map_err(|e| e.to_string())?;
                }
                if self.log_y {
                    chart
                        .draw_series(seg.iter().map(|&p| Circle::new(p, 3, color.filled())))
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        // One run needs no legend; several get one in the corner.
        if self.series.len() > 1 {
            legend(&mut chart, SeriesLabelPosition::LowerRight, 0.8, 11)?;
        }
        Ok(())
    }
}

impl Panel {
    /// The points as drawn: one segment on a linear axis; on a log axis `(x, log10 y)`,
    /// split wherever a point has `y <= 0`.
    fn segments(&self, points: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
        if !self.log_y {
            return vec![points.to_vec()];
        }
        let mut out = vec![Vec::new()];
        for &(x, y) in points {
            match out.last_mut() {
                Some(seg) if y > 0.0 => seg.push((x, y.log10())),
                Some(seg) if !seg.is_empty() => out.push(Vec::new()),
                _ => {}
            }
        }
        out.retain(|seg| !seg.is_empty());
        out
    }
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

/// One group of runs that differ only in their seed, drawn as one band.
#[derive(Debug, Clone)]
pub struct SeedGroup {
    /// The group's name in legends.
    pub label: String,
    /// The runs, one per seed.
    pub runs: Vec<RunCurves>,
}

/// One band of a panel: per x, the mean over the group's runs and the spread (min, max).
#[derive(Debug, Clone, PartialEq)]
pub struct Band {
    /// The band's name in legends.
    pub label: String,
    /// `(x, mean, min, max)` at every x that all runs of the group have.
    pub points: Vec<(f64, f64, f64, f64)>,
    /// Runs in the group.
    pub runs: usize,
}

/// One small chart of bands.
#[derive(Debug, Clone)]
pub struct BandPanel {
    /// The panel's title.
    pub title: String,
    /// The bands drawn.
    pub bands: Vec<Band>,
}

/// Mean and (min, max) across `series` at the x values all of them have.
pub fn band(label: &str, series: &[Series]) -> Band {
    let mut points = Vec::new();
    if let Some(first) = series.first() {
        for &(x, _) in &first.points {
            let ys: Vec<f64> = series
                .iter()
                .filter_map(|s| s.points.iter().find(|p| p.0 == x).map(|p| p.1))
                .filter(|y| y.is_finite())
                .collect();
            if ys.len() == series.len() {
                let mean = ys.iter().sum::<f64>() / ys.len() as f64;
                let lo = ys.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = ys.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                points.push((x, mean, lo, hi));
            }
        }
    }
    Band { label: label.to_string(), points, runs: series.len() }
}

/// One panel of [`seed_panels_with`]: its title and where its values come from.
#[derive(Debug, Clone, PartialEq)]
pub struct SeedPanelSpec {
    /// The panel's title.
    pub title: String,
    /// `None`: the runs' `metrics.jsonl`; `Some(None)`: their evaluations (`eval.jsonl`);
    /// `Some(Some(tag))`: the evaluations at another setting, `eval-<tag>.jsonl` beside it
    /// (`t0.7-p0.9`).
    pub eval: Option<Option<String>>,
    /// The value's path in each JSON row (`["entropy_p99"]`, `["overall", "avg"]`).
    pub key: Vec<String>,
}

impl SeedPanelSpec {
    /// A panel of the metric `key` of metrics.jsonl.
    pub fn metric(title: &str, key: &str) -> Self {
        Self { title: title.into(), eval: None, key: vec![key.into()] }
    }

    /// A panel of the evaluations' `overall.avg` (at the setting `tag`, or the configured one).
    pub fn eval_avg(title: &str, tag: Option<&str>) -> Self {
        Self {
            title: title.into(),
            eval: Some(tag.map(str::to_string)),
            key: vec!["overall".into(), "avg".into()],
        }
    }
}

/// The seed-group panels: held-out avg@n, reward, entropy (mean and 0.99-quantile),
/// silenced ratio, S2T candidates per 10k tokens, and the shares of the logit-gradient
/// norm carried by silenced tokens, by the candidates and by the top 1% of tokens.
pub fn seed_panels(groups: &[SeedGroup]) -> Result<Vec<BandPanel>> {
    let specs = [
        SeedPanelSpec::eval_avg("held-out accuracy (avg@n)", None),
        SeedPanelSpec::metric("reward (mean)", "reward_mean"),
        SeedPanelSpec::metric("entropy (nats/token)", "entropy"),
        SeedPanelSpec::metric("entropy p99 (nats)", "entropy_p99"),
        SeedPanelSpec::metric("silenced-token ratio", "silenced_ratio"),
        SeedPanelSpec::metric("S2T candidates per 10k tokens", "candidates_per_10k"),
        SeedPanelSpec::metric("grad-norm share of silenced tokens", "silenced_grad_share"),
        SeedPanelSpec::metric("grad-norm share of candidates", "candidate_grad_share"),
        SeedPanelSpec::metric("grad-norm share of top 1% tokens", "top_1pct_grad_share"),
    ];
    seed_panels_with(groups, &specs)
}

/// Band panels of the given values, one band per group (mean and min..max over its runs).
/// An evaluation file a run lacks gives that panel no band points for the group.
pub fn seed_panels_with(groups: &[SeedGroup], specs: &[SeedPanelSpec]) -> Result<Vec<BandPanel>> {
    let mut panels: Vec<BandPanel> =
        specs.iter().map(|s| BandPanel { title: s.title.clone(), bands: Vec::new() }).collect();
    let read = |p: &Path| -> Result<Vec<serde_json::Value>> {
        if p.is_file() {
            read_jsonl::<serde_json::Value>(p)
        } else {
            Ok(Vec::new())
        }
    };
    for g in groups {
        let mut metrics = Vec::new();
        for r in &g.runs {
            metrics.push(read_jsonl::<serde_json::Value>(&r.metrics)?);
        }
        for (panel, spec) in panels.iter_mut().zip(specs) {
            let key: Vec<&str> = spec.key.iter().map(String::as_str).collect();
            let mut ss = Vec::new();
            for (r, m) in g.runs.iter().zip(&metrics) {
                let rows = match &spec.eval {
                    None => None,
                    Some(tag) => Some(match (&r.eval, tag) {
                        (Some(e), None) => read(e)?,
                        (Some(e), Some(t)) => read(&e.with_file_name(format!("eval-{t}.jsonl")))?,
                        (None, _) => Vec::new(),
                    }),
                };
                ss.push(series(&g.label, rows.as_deref().unwrap_or(m), "step", &key));
            }
            panel.bands.push(band(&g.label, &ss));
        }
    }
    Ok(panels)
}

/// Draws band panels in a grid into `<stem>.png` and `<stem>.svg`: the mean as a line,
/// the spread across seeds as a shaded band.
pub fn plot_bands(panels: &[BandPanel], stem: &Path) -> Result<(PathBuf, PathBuf)> {
    render(&Grid { panels, cell: (440, 320) }, stem)
}

impl GridPanel for BandPanel {
    fn draw_on<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        let points = self.bands.iter().flat_map(|b| b.points.iter().map(|&(x, _, lo, hi)| (x, lo, hi)));
        let mut chart = step_chart(area, &self.title, points, (52, 1e-4), false)?;
        for (i, b) in self.bands.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            if b.points.len() > 1 {
                let mut poly: Vec<(f64, f64)> = b.points.iter().map(|p| (p.0, p.3)).collect();
                poly.extend(b.points.iter().rev().map(|p| (p.0, p.2)));
                chart
                    .draw_series(std::iter::once(Polygon::new(poly, color.mix(0.15).filled())))
                    .map_err(|e| e.to_string())?;
            } else {
                chart
                    .draw_series(
                        b.points
                            .iter()
                            .map(|p| PathElement::new(vec![(p.0, p.2), (p.0, p.3)], color.stroke_width(1))),
                    )
                    .map_err(|e| e.to_string())?;
            }
            let mean: Vec<(f64, f64)> = b.points.iter().map(|p| (p.0, p.1)).collect();
            line(&mut chart, &mean, color, format!("{} (n={})", b.label, b.runs))?;
        }
        if !self.bands.is_empty() {
            legend(&mut chart, SeriesLabelPosition::UpperRight, 0.8, 10)?;
        }
        Ok(())
    }
}

/// Viridis-like colour for `t` in [0, 1] (piecewise linear through five of its stops).
fn viridis(t: f64) -> RGBColor {
    const STOPS: [(u8, u8, u8); 5] =
        [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)];
    let t = if t.is_finite() { t.clamp(0.0, 1.0) } else { 0.0 } * (STOPS.len() - 1) as f64;
    let i = (t.floor() as usize).min(STOPS.len() - 2);
    let f = t - i as f64;
    let mix = |a: u8, b: u8| (a as f64 + (b as f64 - a as f64) * f).round() as u8;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// STAPO's token scatter into `<stem>.png` and `<stem>.svg`: every point a response token
/// of a positive-advantage response, at its probability p (log axis) and entropy H,
/// coloured by its logit-gradient norm (log colour scale, bar on the right); `region` is
/// the S2T region `p < tau_p, H < tau_h` (shaded red), silenced tokens are ringed in red.
pub fn spurious(
    points: &[TokenPoint],
    region: Option<Region>,
    title: &str,
    stem: &Path,
) -> Result<(PathBuf, PathBuf)> {
    render(&Scatter { points, region, title }, stem)
}

/// The figure of [`spurious`].
struct Scatter<'a> {
    points: &'a [TokenPoint],
    region: Option<Region>,
    title: &'a str,
}

impl Figure for Scatter<'_> {
    fn size(&self) -> (u32, u32) {
        (900, 600)
    }

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        draw_spurious(root, self.points, self.region, self.title)
    }
}

fn draw_spurious<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    points: &[TokenPoint],
    region: Option<Region>,
    title: &str,
) -> std::result::Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (main, bar) = root.split_horizontally(root.dim_in_pixel().0 - 110);
    let ok: Vec<&TokenPoint> =
        points.iter().filter(|q| q.p.is_finite() && q.h.is_finite() && q.grad.is_finite()).collect();
    // Axes: p on a log scale down to the smallest probability (and below tau_p).
    let p_min = ok.iter().map(|q| q.p as f64).filter(|&p| p > 0.0).fold(1.0f64, f64::min);
    let p_min = region.map_or(p_min, |r| p_min.min(r.tau_p as f64 / 3.0)).max(1e-12);
    let x0 = 10f64.powf(p_min.log10().floor());
    let h_max = ok.iter().map(|q| q.h as f64).fold(0.0f64, f64::max);
    let h_max = region.map_or(h_max, |r| h_max.max(r.tau_h as f64)).max(0.05) * 1.05;
    // Colour scale: log10 of the gradient norm over the positive norms.
    let gs: Vec<f64> = ok.iter().map(|q| q.grad as f64).filter(|&g| g > 0.0).collect();
    let g_lo = gs.iter().copied().fold(f64::INFINITY, f64::min);
    let g_hi = gs.iter().copied().fold(0.0f64, f64::max);
    let (l_lo, l_hi) =
        if gs.is_empty() { (-3.0, 0.0) } else { (g_lo.log10(), g_hi.log10().max(g_lo.log10() + 1e-6)) };
    let shade =
        move |g: f64| if g > 0.0 { viridis((g.log10() - l_lo) / (l_hi - l_lo)) } else { viridis(0.0) };

    let n_sil = ok.iter().filter(|q| q.silenced).count();
    let mut chart = ChartBuilder::on(&main)
        .caption(title, ("sans-serif", 17))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((x0..1.0f64).log_scale(), 0.0..h_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("p (probability of the sampled token, log scale)")
        .y_desc("H (entropy at the position, nats)")
        .x_label_formatter(&|x| format!("{x:.0e}"))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| e.to_string())?;
    if let Some(r) = region {
        let (tp, th) = (r.tau_p as f64, r.tau_h as f64);
        chart
            .draw_series(std::iter::once(Rectangle::new([(x0, 0.0), (tp, th)], RED.mix(0.10).filled())))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(std::iter::once(Rectangle::new([(x0, 0.0), (tp, th)], RED.stroke_width(2))))
            .map_err(|e| e.to_string())?
            .label(format!("S2T region (last update): p < {}, H < {:.3}", tick(tp), th))
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], RED.mix(0.3).filled()));
    }
    // Small gradients first, so the large ones are drawn on top.
    let mut order = ok.clone();
    order.sort_by(|a, b| a.grad.total_cmp(&b.grad));
    chart
        .draw_series(
            order.iter().map(|q| Circle::new((q.p as f64, q.h as f64), 3, shade(q.grad as f64).filled())),
        )
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(
            order
                .iter()
                .filter(|q| q.silenced)
                .map(|q| Circle::new((q.p as f64, q.h as f64), 7, RED.stroke_width(2))),
        )
        .map_err(|e| e.to_string())?
        .label(format!("silenced by S2T ({n_sil})"))
        .legend(|(x, y)| Circle::new((x + 7, y), 5, RED.stroke_width(2)));
    legend(&mut chart, SeriesLabelPosition::UpperLeft, 0.85, 12)?;

    // The colour bar: log10 of the gradient norm.
    let mut cb = ChartBuilder::on(&bar)
        .caption("|grad|", ("sans-serif", 13))
        .margin_top(40)
        .margin_bottom(50)
        .margin_right(50)
        .y_label_area_size(0)
        .right_y_label_area_size(45)
        .build_cartesian_2d(0.0..1.0f64, l_lo..l_hi)
        .map_err(|e| e.to_string())?;
    cb.configure_mesh()
        .disable_x_mesh()
        .disable_x_axis()
        .disable_y_mesh()
        .y_labels(6)
        .y_label_formatter(&|v| format!("{:.0e}", 10f64.powf(*v)))
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(|e| e.to_string())?;
    let steps = 64;
    let dv = (l_hi - l_lo) / steps as f64;
    cb.draw_series((0..steps).map(|i| {
        let v = l_lo + i as f64 * dv;
        Rectangle::new([(0.0, v), (1.0, v + dv)], viridis(i as f64 / (steps - 1) as f64).filled())
    }))
    .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_panels_split_at_zeros_and_draw_log10() {
        let p = Panel { title: "t".into(), series: Vec::new(), log_y: true };
        let pts = [(0.0, 0.0), (1.0, 10.0), (2.0, 100.0), (3.0, 0.0), (4.0, 0.0), (5.0, 1.0), (6.0, -1.0)];
        assert_eq!(p.segments(&pts), vec![vec![(1.0, 1.0), (2.0, 2.0)], vec![(5.0, 0.0)]]);
        let lin = Panel { log_y: false, ..p };
        assert_eq!(lin.segments(&pts), vec![pts.to_vec()]);
    }

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
    fn bands_are_mean_min_max_over_the_seeds() {
        let s = |pts: &[(f64, f64)]| Series { label: "x".into(), points: pts.to_vec() };
        // Step 2 is missing from the second run: only steps both runs have are banded.
        let b = band("stapo", &[s(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), s(&[(0.0, 3.0), (1.0, 1.0)])]);
        assert_eq!(b.points, vec![(0.0, 2.0, 1.0, 3.0), (1.0, 2.0, 1.0, 3.0)]);
        assert_eq!(b.runs, 2);
    }

    /// Chosen panels: a metric and the evaluations at another setting (eval-<tag>.jsonl beside
    /// eval.jsonl), averaged over the runs by hand.
    #[test]
    fn seed_panels_with_chosen_values_read_the_other_setting() {
        let dir = tempfile::tempdir().unwrap();
        let mut runs = Vec::new();
        for seed in 0..2 {
            let d = dir.path().join(format!("s{seed}"));
            std::fs::create_dir_all(&d).unwrap();
            let rows: String = (0..3)
                .map(|s| format!("{{\"step\":{s},\"entropy_p99\":{}}}\n", 1.0 + seed as f64 + s as f64))
                .collect();
            std::fs::write(d.join("metrics.jsonl"), rows).unwrap();
            std::fs::write(d.join("eval.jsonl"), "{\"step\":0,\"overall\":{\"avg\":0.9}}\n").unwrap();
            std::fs::write(
                d.join("eval-t0.7-p0.9.jsonl"),
                format!("{{\"step\":0,\"overall\":{{\"avg\":{}}}}}\n", 0.2 + 0.2 * seed as f64),
            )
            .unwrap();
            runs.push(RunCurves {
                label: "a".into(),
                metrics: d.join("metrics.jsonl"),
                eval: Some(d.join("eval.jsonl")),
            });
        }
        let specs = [
            SeedPanelSpec::metric("entropy p99", "entropy_p99"),
            SeedPanelSpec::eval_avg("avg@8 at T 0.7", Some("t0.7-p0.9")),
            SeedPanelSpec::eval_avg("avg@8 at T 1.0", None),
            SeedPanelSpec::eval_avg("no such setting", Some("t0.5-p1")),
        ];
        let panels = seed_panels_with(&[SeedGroup { label: "a".into(), runs }], &specs).unwrap();
        assert_eq!(panels.iter().map(|p| p.title.as_str()).collect::<Vec<_>>(), specs.map(|s| s.title));
        // Step 2: 3.0 and 4.0 over the seeds.
        assert_eq!(panels[0].bands[0].points[2], (2.0, 3.5, 3.0, 4.0));
        let (x, mean, lo, hi) = panels[1].bands[0].points[0];
        assert!(
            x == 0.0 && (mean - 0.3).abs() < 1e-12 && (lo - 0.2).abs() < 1e-12 && (hi - 0.4).abs() < 1e-12
        );
        assert_eq!(panels[2].bands[0].points, [(0.0, 0.9, 0.9, 0.9)]);
        assert!(panels[3].bands[0].points.is_empty());
        let (png, _) = plot_bands(&panels, &dir.path().join("fig")).unwrap();
        assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
        // Two panels: one row of two cells, no empty third column.
        let (_, svg) = plot_bands(&panels[..2], &dir.path().join("two")).unwrap();
        let svg = std::fs::read_to_string(svg).unwrap();
        assert!(svg.contains("width=\"880\" height=\"320\""), "{}", &svg[..200]);
    }

    #[test]
    fn seed_panels_and_the_spurious_scatter_render() {
        let dir = tempfile::tempdir().unwrap();
        let mut runs = Vec::new();
        for seed in 0..3 {
            let m = dir.path().join(format!("m{seed}.jsonl"));
            let e = dir.path().join(format!("e{seed}.jsonl"));
            let lines: String = (0..4)
                .map(|s| format!("{{\"step\":{s},\"reward_mean\":0.5,\"entropy\":{},\"silenced_ratio\":0.0,\"silenced_grad_share\":0.01,\"top_grad_share\":0.02}}\n", 0.1 * (seed + s) as f64))
                .collect();
            std::fs::write(&m, lines).unwrap();
            std::fs::write(
                &e,
                format!(
                    "{{\"step\":0,\"overall\":{{\"avg\":0.4}}}}\n{{\"step\":4,\"overall\":{{\"avg\":{}}}}}\n",
                    0.1 * seed as f64
                ),
            )
            .unwrap();
            runs.push(RunCurves { label: format!("s{seed}"), metrics: m, eval: Some(e) });
        }
        let panels = seed_panels(&[SeedGroup { label: "grpo".into(), runs }]).unwrap();
        assert_eq!(panels.len(), 9);
        let eval = &panels[0].bands[0];
        assert_eq!(eval.points.len(), 2);
        let last = eval.points[1];
        assert!((last.1 - 0.1).abs() < 1e-12 && last.2 == 0.0 && (last.3 - 0.2).abs() < 1e-12, "{last:?}");
        // Entropy at step 1: 0.1, 0.2, 0.3 over the seeds.
        let h = panels[2].bands[0].points[1];
        assert!((h.1 - 0.2).abs() < 1e-9 && (h.2 - 0.1).abs() < 1e-9 && (h.3 - 0.3).abs() < 1e-9, "{h:?}");
        let (png, svg) = plot_bands(&panels, &dir.path().join("stress")).unwrap();
        assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
        assert!(std::fs::read_to_string(&svg).unwrap().contains("grpo (n=3)"));

        let pts = [
            TokenPoint { p: 0.9, h: 0.1, grad: 0.1, silenced: false },
            TokenPoint { p: 0.001, h: 0.05, grad: 1.4, silenced: true },
        ];
        let (png, svg) =
            spurious(&pts, Some(Region { tau_p: 0.002, tau_h: 0.3 }), "test", &dir.path().join("spurious"))
                .unwrap();
        assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("silenced by S2T (1)") && text.contains("S2T region"), "{text}");
        // Colour ends: the smallest norm gets viridis' first stop, the largest its last.
        assert_eq!(viridis(0.0), RGBColor(68, 1, 84));
        assert_eq!(viridis(1.0), RGBColor(253, 231, 37));
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
