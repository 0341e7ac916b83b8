//! The pictures ColabFold writes beside a query's predictions, drawn the way its plotting code
//! draws them (`colabfold/plot.py`'s `plot_msa_v2`, `colabfold/colabfold.py`'s `plot_paes` and
//! `plot_plddts`, saved by `colabfold/batch.py` at 200 dpi):
//!
//! - `<name>_pae.png`: one heat map per model, best first, titled `rank_1`, `rank_2`, ..., of
//!   the predicted aligned error (row: aligned residue, top to bottom; column: scored residue),
//!   blue-white-red from 0 to 30 Å (matplotlib's `bwr`), each with its colour bar; chains of a
//!   complex separated by black lines and named A, B, ... on the rows. Only models with the
//!   aligned-error head (the `_ptm` sets) have one; without any, no file.
//! - `<name>_plddt.png`: the per-residue pLDDT of every model on one chart, one line per model
//!   in ColabFold's colours, 0 to 100, with a legend.
//! - `<name>_coverage.png`: the MSA, one row per sequence, coloured where the sequence has a
//!   residue (white at gaps) by its identity to the query (red 0 to blue 1, matplotlib's
//!   `rainbow_r`), rows sorted by identity (the query on top), and a black line of the number of
//!   sequences with a residue at each position.
//!
//! Drawn with plotters into an RGB buffer and encoded by `image`; text in DejaVu Sans, shipped
//! under `assets/fonts` (no system fonts needed).
use std::io::Write;
use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, bail, Context};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontTransform;

/// ColabFold's resolution (`batch.py`'s `dpi=200`): each figure is its size in inches times this.
pub const DPI: u32 = 200;
/// The pLDDT and coverage figures: 8 x 5 inches, as ColabFold's.
pub const WIDE: (u32, u32) = (8 * DPI, 5 * DPI);
/// One model's panel of the PAE figure: 3 x 2 inches, side by side.
pub const PAE_PANEL: (u32, u32) = (3 * DPI, 2 * DPI);
/// The top of the PAE colour scale, Å (ColabFold's `vmax=30`; larger errors are red too).
pub const PAE_MAX: f64 = 30.0;

/// The MSA class of a gap (AlphaFold's HHblits order, as [`crate::features::RawFeatures`] has it).
const GAP: i64 = 21;
/// DejaVu Sans cut to printable ASCII and a few signs (`assets/fonts/LICENSE`).
const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");
const FAMILY: &str = "sans-serif";
/// Tick labels and axis names (10 pt at 200 dpi is 28 px) and titles.
const TEXT: f64 = 26.0;
const TITLE: f64 = 32.0;
/// matplotlib's default colour cycle (`tab10`), the lines' colours in ColabFold's pLDDT plot.
const TAB10: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// The names ColabFold gives a query's plots: `<name>_pae.png`, `<name>_plddt.png` and
/// `<name>_coverage.png`.
pub fn file_names(name: &str) -> [String; 3] {
    [format!("{name}_pae.png"), format!("{name}_plddt.png"), format!("{name}_coverage.png")]
}

/// One model's confidence, as the plots take it.
pub struct ModelConfidence<'a> {
    /// Per-residue pLDDT, 0 to 100.
    pub plddt: &'a [f64],
    /// The predicted aligned error `[N][N]`, Å (models with the aligned-error head).
    pub pae: Option<&'a [Vec<f64>]>,
}

/// Writes query `name`'s plots into `dir` (see the module docs): `ranked` are its models, best
/// first; `msa` its alignment rows (classes 0..=21, row 0 the query; `None` when the input has
/// none, as a processed features file: no coverage plot); `chains` the residues of each chain
/// (one entry for a monomer). Returns the files written.
pub fn write(
    dir: &Path,
    name: &str,
    ranked: &[ModelConfidence],
    msa: Option<&[Vec<i64>]>,
    chains: &[usize],
) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let [pae_file, plddt_file, coverage_file] = file_names(name);
    let label = |i: usize| format!("rank_{}", i + 1);
    let mut figures = Vec::new();
    let paes: Vec<(String, &[Vec<f64>])> =
        ranked.iter().enumerate().filter_map(|(i, m)| m.pae.map(|p| (label(i), p))).collect();
    if !paes.is_empty() {
        figures.push((pae_file, pae(&paes, chains)?));
    }
    let plddts: Vec<(String, &[f64])> = ranked.iter().enumerate().map(|(i, m)| (label(i), m.plddt)).collect();
    figures.push((plddt_file, plddt(&plddts, chains)?));
    if let Some(msa) = msa {
        figures.push((coverage_file, coverage(msa, chains)?));
    }
    let mut written = Vec::new();
    for (file, figure) in figures {
        let path = dir.join(file);
        let png = figure.png()?;
        data::write_atomic(&path, |w| -> anyhow::Result<()> { Ok(w.write_all(&png)?) })
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// A drawn figure: RGB pixels, row by row, and where each panel's data lies.
pub struct Figure {
    /// Pixels across.
    pub width: u32,
    /// Pixels down.
    pub height: u32,
    /// `width * height` RGB triples.
    pub rgb: Vec<u8>,
    /// Each panel's data area (the PAE figure: one per model; the others: one).
    pub panels: Vec<Panel>,
}

impl Figure {
    /// The colour at pixel `(x, y)`.
    pub fn pixel(&self, x: i32, y: i32) -> [u8; 3] {
        let i = 3 * (y as usize * self.width as usize + x as usize);
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }

    /// The figure as a PNG file's bytes.
    pub fn png(&self) -> anyhow::Result<Vec<u8>> {
        data::images::encode_png(&self.rgb, self.width as usize, self.height as usize, 3).map_err(|e| anyhow!(e))
    }
}

/// Where a panel's data lies in its figure: pixel columns and rows (the first at the data's
/// left and top edges, the last just past its right and bottom edges).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Panel {
    /// Columns, left to right.
    pub x: Range<i32>,
    /// Rows, top to bottom.
    pub y: Range<i32>,
}

impl Panel {
    /// The pixel at fractions `(fx, fy)` of the data area, from its left and top edges.
    pub fn at(&self, fx: f64, fy: f64) -> (i32, i32) {
        let lerp = |r: &Range<i32>, f: f64| r.start + (f * (r.end - r.start) as f64).floor() as i32;
        (lerp(&self.x, fx), lerp(&self.y, fy))
    }
}

/// matplotlib's `bwr` at `v` on a scale from 0 to `max`: blue, white at the middle, red.
pub fn bwr(v: f64, max: f64) -> RGBColor {
    let t = (v / max).clamp(0.0, 1.0);
    let (r, g, b) = if t < 0.5 { (2.0 * t, 2.0 * t, 1.0) } else { (1.0, 2.0 * (1.0 - t), 2.0 * (1.0 - t)) };
    rgb(r, g, b)
}

/// matplotlib's `rainbow_r` at `t` in [0, 1]: `rainbow` (gnuplot's functions 33, 13, 10)
/// reversed, red at 0 through green to violet-blue at 1.
pub fn rainbow_r(t: f64) -> RGBColor {
    let x = 1.0 - t.clamp(0.0, 1.0);
    let pi = std::f64::consts::PI;
    rgb((2.0 * x - 0.5).abs(), (pi * x).sin(), (pi * x / 2.0).cos())
}

fn rgb(r: f64, g: f64, b: f64) -> RGBColor {
    let c = |v: f64| (v.clamp(0.0, 1.0) * 255.0).round() as u8;
    RGBColor(c(r), c(g), c(b))
}

/// The plots' font, registered with plotters once.
fn font(size: f64) -> TextStyle<'static> {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // The font is compiled in and known to parse (the tests draw text with it).
        let _ = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT);
    });
    (FAMILY, size).into_font().color(&BLACK)
}

/// plotters' errors, with what was being drawn.
fn drawing<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> anyhow::Error {
    move |e| anyhow!("drawing the {what} plot: {e:?}")
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// A white figure of `size` pixels, drawn by `draw`, which returns its panels.
fn figure(
    size: (u32, u32),
    what: &'static str,
    draw: impl FnOnce(&Area) -> anyhow::Result<Vec<Panel>>,
) -> anyhow::Result<Figure> {
    let mut rgb = vec![255u8; size.0 as usize * size.1 as usize * 3];
    let panels = {
        let root = BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area();
        let panels = draw(&root)?;
        root.present().map_err(drawing(what))?;
        panels
    };
    Ok(Figure { width: size.0, height: size.1, rgb, panels })
}

/// The chain boundaries inside `0..total` residues: the cumulative lengths but the last.
fn boundaries(chains: &[usize]) -> Vec<f64> {
    chains
        .iter()
        .scan(0, |at, &n| {
            *at += n;
            Some(*at as f64)
        })
        .take(chains.len().saturating_sub(1))
        .collect()
}

/// The number of residues the chain lengths add up to, which must be `n`.
fn check_chains(chains: &[usize], n: usize, what: &str) -> anyhow::Result<()> {
    if chains.iter().sum::<usize>() != n || chains.contains(&0) {
        bail!("chain lengths {chains:?} do not add up to the {n} residues of the {what}");
    }
    Ok(())
}

/// A tick label: the value with at most two decimals, without trailing zeros.
fn tick(v: &f64) -> String {
    let text = format!("{v:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".to_string()
    } else {
        text.to_string()
    }
}

/// A pixel range of a chart's plotting area as a [`Panel`].
fn panel<X, Y>(chart: &ChartContext<BitMapBackend, Cartesian2d<X, Y>>) -> Panel
where
    X: plotters::coord::ranged1d::Ranged,
    Y: plotters::coord::ranged1d::Ranged,
{
    let (x, y) = chart.plotting_area().get_pixel_range();
    Panel { x, y }
}

/// The colour bar's width and the room for its tick labels right of it, pixels.
const BAR: (u32, u32) = (36, 80);

/// A vertical colour bar from 0 to `max` at the left of `area`, its ends `margin` (top, bottom)
/// from the area's, with tick labels right of it and, when given, its name beside them, read
/// upwards (matplotlib's `colorbar(label=...)`).
fn colour_bar(
    area: &Area,
    margin: (u32, u32),
    max: f64,
    colour: impl Fn(f64) -> RGBColor,
    label: Option<&str>,
    what: &'static str,
) -> anyhow::Result<()> {
    let (strip, rest) = area.split_horizontally(BAR.0 + BAR.1);
    let mut bar = ChartBuilder::on(&strip)
        .margin_top(margin.0)
        .margin_bottom(margin.1)
        .right_y_label_area_size(BAR.1)
        .build_cartesian_2d(0.0..1.0, 0.0..max)
        .map_err(drawing(what))?;
    const STEPS: usize = 128;
    let step = max / STEPS as f64;
    bar.draw_series((0..STEPS).map(|i| {
        let v = i as f64 * step;
        Rectangle::new([(0.0, v), (1.0, v + step)], colour(v + step / 2.0).filled())
    }))
    .map_err(drawing(what))?;
    bar.configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(6)
        .set_all_tick_mark_size(8)
        .label_style(font(TEXT))
        .y_label_formatter(&tick)
        .draw()
        .map_err(drawing(what))?;
    if let Some(label) = label {
        let style = font(TEXT).transform(FontTransform::Rotate270);
        let (text_w, _) = rest.estimate_text_size(label, &style).map_err(drawing(what))?;
        let (_, h) = rest.dim_in_pixel();
        let centre = margin.0 as i32 + (h as i32 - margin.0 as i32 - margin.1 as i32) / 2;
        rest.draw(&Text::new(label, (4, centre + text_w as i32 / 2), style)).map_err(drawing(what))?;
    }
    Ok(())
}

/// ColabFold's `<name>_pae.png`: one heat map per `(title, pae)`, side by side (see the module
/// docs). `chains`: the residues of each chain.
pub fn pae(models: &[(String, &[Vec<f64>])], chains: &[usize]) -> anyhow::Result<Figure> {
    const WHAT: &str = "PAE";
    let (w, h) = PAE_PANEL;
    for (title, m) in models {
        check_chains(chains, m.len(), &format!("{title} PAE matrix"))?;
        if let Some(row) = m.iter().find(|r| r.len() != m.len()) {
            bail!("the {title} PAE matrix is not square: a row of {} beside {} rows", row.len(), m.len());
        }
    }
    figure((w * models.len().max(1) as u32, h), WHAT, |root| {
        root.fill(&WHITE).map_err(drawing(WHAT))?;
        let mut panels = Vec::new();
        for (area, (title, m)) in root.split_evenly((1, models.len().max(1))).iter().zip(models) {
            let n = m.len() as f64;
            let (head, body) = area.split_vertically(TITLE as u32 + 24);
            let (body_w, body_h) = body.dim_in_pixel();
            // The heat map square, as imshow keeps it, with its tick labels left and below.
            let (left, below, top, gap) = (64u32, 40u32, 6u32, 26u32);
            let side = (body_h - below - top).min(body_w - left - gap - BAR.0 - BAR.1);
            // The title centred over the heat map, as matplotlib's over its axes.
            let centred = font(TITLE).pos(Pos::new(HPos::Center, VPos::Bottom));
            let at = ((left + side / 2) as i32, TITLE as i32 + 16);
            head.draw(&Text::new(title.as_str(), at, centred)).map_err(drawing(WHAT))?;
            let (heat, rest) = body.split_horizontally(left + side);
            let mut chart = ChartBuilder::on(&heat)
                .margin_top(top)
                .margin_bottom(body_h - top - side - below)
                .x_label_area_size(below)
                .y_label_area_size(left)
                .build_cartesian_2d(0.0..n, n..0.0)
                .map_err(drawing(WHAT))?;
            chart
                .draw_series(m.iter().enumerate().flat_map(|(i, row)| {
                    row.iter().enumerate().map(move |(j, &v)| {
                        let (i, j) = (i as f64, j as f64);
                        Rectangle::new([(j, i), (j + 1.0, i + 1.0)], bwr(v, PAE_MAX).filled())
                    })
                }))
                .map_err(drawing(WHAT))?;
            let several = chains.len() > 1;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_labels(4)
                .y_labels(if several { 0 } else { 4 })
                .label_style(font(TEXT))
                .x_label_formatter(&tick)
                .y_label_formatter(&tick)
                .draw()
                .map_err(drawing(WHAT))?;
            for b in boundaries(chains) {
                let lines = [vec![(b, 0.0), (b, n)], vec![(0.0, b), (n, b)]];
                chart.draw_series(lines.map(|l| PathElement::new(l, BLACK.stroke_width(2)))).map_err(drawing(WHAT))?;
            }
            if several {
                // The chains' letters on the rows, as ColabFold's plot_ticks puts them.
                let base_y = heat.get_base_pixel().1;
                let mut start = 0.0;
                for (c, &len) in chains.iter().enumerate() {
                    let (_, y) = chart.backend_coord(&(0.0, start + len as f64 / 2.0));
                    start += len as f64;
                    let letter = char::from(b'A' + (c % 26) as u8).to_string();
                    let at = (left as i32 - 30, y - base_y - TEXT as i32 / 2);
                    heat.draw(&Text::new(letter, at, font(TEXT))).map_err(drawing(WHAT))?;
                }
            }
            let bar = rest.margin(0, 0, gap, 0);
            colour_bar(&bar, (top, body_h - top - side), PAE_MAX, |v| bwr(v, PAE_MAX), None, WHAT)?;
            panels.push(panel(&chart));
        }
        Ok(panels)
    })
}

/// A chart over positions: its axes without a grid, ticks in the plots' font, the x axis named
/// "Positions" and the y axis `y`.
fn named_axes(
    chart: &mut ChartContext<BitMapBackend, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    y: &str,
    what: &'static str,
) -> anyhow::Result<()> {
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("Positions")
        .y_desc(y)
        .label_style(font(TEXT))
        .axis_desc_style(font(TEXT))
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .draw()
        .map_err(drawing(what))
}

/// Axis ranges a little wider than the data, as matplotlib's autoscaling leaves them (5% of
/// the span each side).
fn padded(lo: f64, hi: f64) -> Range<f64> {
    let pad = 0.05 * (hi - lo).max(1.0);
    (lo - pad)..(hi + pad)
}

/// ColabFold's `<name>_plddt.png`: every `(label, plddt)` as a line on one chart, 0 to 100,
/// chains separated by black lines.
pub fn plddt(models: &[(String, &[f64])], chains: &[usize]) -> anyhow::Result<Figure> {
    const WHAT: &str = "pLDDT";
    for (label, p) in models {
        check_chains(chains, p.len(), &format!("{label} pLDDT"))?;
    }
    let n = chains.iter().sum::<usize>();
    figure(WIDE, WHAT, |root| {
        root.fill(&WHITE).map_err(drawing(WHAT))?;
        let body =
            root.margin(12, 0, 0, 0).titled("Predicted lDDT per position", font(TITLE)).map_err(drawing(WHAT))?;
        let mut chart = ChartBuilder::on(&body)
            .margin(30)
            .x_label_area_size(90)
            .y_label_area_size(110)
            .build_cartesian_2d(padded(0.0, n.saturating_sub(1) as f64), 0.0..100.0)
            .map_err(drawing(WHAT))?;
        named_axes(&mut chart, "Predicted lDDT", WHAT)?;
        for (k, (label, p)) in models.iter().enumerate() {
            let colour = TAB10[k % TAB10.len()];
            let points = p.iter().enumerate().map(|(i, &v)| (i as f64, v));
            chart
                .draw_series(LineSeries::new(points, colour.stroke_width(3)))
                .map_err(drawing(WHAT))?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3)));
        }
        for b in boundaries(chains) {
            chart
                .draw_series([PathElement::new(vec![(b, 0.0), (b, 100.0)], BLACK.stroke_width(2))])
                .map_err(drawing(WHAT))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .margin(20)
            .label_font(font(TEXT))
            .background_style(WHITE.mix(0.8))
            .border_style(RGBColor(0xcc, 0xcc, 0xcc))
            .draw()
            .map_err(drawing(WHAT))?;
        Ok(vec![panel(&chart)])
    })
}

/// The coverage plot's rows, as ColabFold's `plot_msa_v2` orders them: the sequences grouped
/// by which chains they have residues in (groups in NumPy's `unique` order: none before some),
/// each group sorted by identity, lowest first (drawn from the bottom, so the query is on top).
#[derive(Clone, Debug, PartialEq)]
pub struct Coverage {
    /// Per row, bottom to top: its identity to the query (the share of each chain's positions
    /// that match, averaged over the chains it covers) and where it has a residue.
    pub rows: Vec<(f64, Vec<bool>)>,
    /// Where each group after the first starts (row index).
    pub group_starts: Vec<usize>,
}

impl Coverage {
    /// The rows of `msa` (row 0 the query) over `chains`.
    pub fn new(msa: &[Vec<i64>], chains: &[usize]) -> anyhow::Result<Coverage> {
        let query = msa.first().context("the coverage plot needs an MSA with at least the query")?;
        check_chains(chains, query.len(), "MSA's query")?;
        if let Some((i, row)) = msa.iter().enumerate().find(|(_, r)| r.len() != query.len()) {
            bail!("MSA row {i} has {} columns, the query {}", row.len(), query.len());
        }
        let spans: Vec<Range<usize>> = chains
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some(*at - n..*at)
            })
            .collect();
        let mut keyed: Vec<(Vec<bool>, f64, Vec<bool>)> = msa
            .iter()
            .map(|row| {
                let present: Vec<bool> = row.iter().map(|&c| c != GAP).collect();
                let covers: Vec<bool> = spans.iter().map(|s| present[s.clone()].iter().any(|&p| p)).collect();
                let same = |s: &Range<usize>| s.clone().filter(|&i| row[i] == query[i]).count() as f64 / s.len() as f64;
                let covered = covers.iter().filter(|&&c| c).count() as f64;
                let identity = spans.iter().map(same).sum::<f64>() / (covered + 1e-8);
                (covers, identity, present)
            })
            .collect();
        // Grouped (false before true, chain by chain), then by identity; stable within ties.
        keyed.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let group_starts = (1..keyed.len()).filter(|&i| keyed[i].0 != keyed[i - 1].0).collect();
        Ok(Coverage { rows: keyed.into_iter().map(|(_, id, present)| (id, present)).collect(), group_starts })
    }
}

/// ColabFold's `<name>_coverage.png` of `msa` (classes 0..=21, row 0 the query) over `chains`:
/// see the module docs and [`Coverage`].
pub fn coverage(msa: &[Vec<i64>], chains: &[usize]) -> anyhow::Result<Figure> {
    const WHAT: &str = "coverage";
    let cov = Coverage::new(msa, chains)?;
    let (cols, rows) = (chains.iter().sum::<usize>() as f64, cov.rows.len() as f64);
    figure(WIDE, WHAT, |root| {
        root.fill(&WHITE).map_err(drawing(WHAT))?;
        let body = root.margin(12, 0, 0, 0).titled("Sequence coverage", font(TITLE)).map_err(drawing(WHAT))?;
        let (main, bar) = body.split_horizontally(WIDE.0 - 230);
        let (top, below) = (30u32, 90u32);
        let mut chart = ChartBuilder::on(&main)
            .margin_top(top)
            .margin_left(30)
            .margin_right(30)
            .x_label_area_size(below)
            .y_label_area_size(120)
            .build_cartesian_2d(0.0..cols, 0.0..rows)
            .map_err(drawing(WHAT))?;
        // One rectangle per run of residues in a row: a row has one colour.
        let runs = cov.rows.iter().enumerate().flat_map(|(r, (identity, present))| {
            let colour = rainbow_r(*identity);
            let mut runs = Vec::new();
            let mut start = None;
            for (c, &p) in present.iter().chain([&false]).enumerate() {
                match (p, start) {
                    (true, None) => start = Some(c),
                    (false, Some(s)) => {
                        runs.push(Rectangle::new([(s as f64, r as f64), (c as f64, r as f64 + 1.0)], colour.filled()));
                        start = None;
                    }
                    _ => {}
                }
            }
            runs
        });
        chart.draw_series(runs).map_err(drawing(WHAT))?;
        for b in boundaries(chains) {
            chart
                .draw_series([PathElement::new(vec![(b, 0.0), (b, rows)], BLACK.stroke_width(2))])
                .map_err(drawing(WHAT))?;
        }
        for &g in &cov.group_starts {
            let g = g as f64;
            chart
                .draw_series([PathElement::new(vec![(0.0, g), (cols, g)], BLACK.stroke_width(2))])
                .map_err(drawing(WHAT))?;
        }
        let depth = (0..cols as usize).map(|c| (c as f64 + 0.5, cov.rows.iter().filter(|(_, p)| p[c]).count() as f64));
        chart.draw_series(LineSeries::new(depth, BLACK.stroke_width(3))).map_err(drawing(WHAT))?;
        named_axes(&mut chart, "Sequences", WHAT)?;
        let label = Some("Sequence identity to query");
        colour_bar(&bar, (top, below), 1.0, rainbow_r, label, WHAT)?;
        Ok(vec![panel(&chart)])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn colour(c: RGBColor) -> [u8; 3] {
        [c.0, c.1, c.2]
    }

    /// Whether two colours differ by at most `tol` in every channel.
    fn near(a: [u8; 3], b: [u8; 3], tol: u8) -> bool {
        a.iter().zip(b).all(|(x, y)| x.abs_diff(y) <= tol)
    }

    #[test]
    fn colour_maps_are_matplotlibs() {
        assert_eq!(colour(bwr(0.0, 30.0)), [0, 0, 255]);
        assert_eq!(colour(bwr(15.0, 30.0)), [255, 255, 255]);
        assert_eq!(colour(bwr(30.0, 30.0)), [255, 0, 0]);
        assert_eq!(colour(bwr(45.0, 30.0)), [255, 0, 0], "above the scale: its top colour");
        // matplotlib: cm.rainbow_r(0.0), (0.5), (1.0) (rainbow at 1, 0.5, 0).
        assert_eq!(colour(rainbow_r(0.0)), [255, 0, 0]);
        assert_eq!(colour(rainbow_r(0.5)), [128, 255, 180]);
        assert_eq!(colour(rainbow_r(1.0)), [128, 0, 255]);
    }

    #[test]
    fn a_known_pae_matrix_gives_its_pattern() {
        // 12 residues: low error within the first 4 and within the last 8, high between them,
        // and one cell (row 10, column 1) at the middle of the scale.
        let n = 12;
        let mut pae = vec![vec![0.0; n]; n];
        for (i, row) in pae.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = if (i < 4) == (j < 4) { 1.0 } else { 29.0 };
            }
        }
        pae[10][1] = 15.0;
        let models = [("rank_1".to_string(), &pae[..]), ("rank_2".to_string(), &pae[..])];
        let f = pae_figure(&models, &[n]);
        assert_eq!((f.width, f.height), (2 * PAE_PANEL.0, PAE_PANEL.1));
        assert_eq!(f.panels.len(), 2);
        for p in &f.panels {
            let (w, h) = (p.x.end - p.x.start, p.y.end - p.y.start);
            assert!((w - h).abs() <= 1 && w > 200, "a square heat map: {p:?}");
            for (i, row) in pae.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    let (x, y) = p.at((j as f64 + 0.5) / n as f64, (i as f64 + 0.5) / n as f64);
                    let got = f.pixel(x, y);
                    assert!(near(got, colour(bwr(v, PAE_MAX)), 2), "cell ({i}, {j}) = {v}: pixel {got:?}");
                }
            }
        }
        // The second panel sits to the right of the first, one panel's width on.
        assert_eq!(f.panels[1].x.start - f.panels[0].x.start, PAE_PANEL.0 as i32);
        // The colour bar right of the heat map: red at its top, blue at its bottom.
        let p = &f.panels[0];
        let has = |y: i32, want: [u8; 3]| (p.x.end + 10..p.x.end + 60).any(|x| near(f.pixel(x, y), want, 6));
        assert!(has(p.y.start + 3, [255, 0, 0]) && has(p.y.end - 3, [0, 0, 255]), "no colour bar");
    }

    fn pae_figure(models: &[(String, &[Vec<f64>])], chains: &[usize]) -> Figure {
        pae(models, chains).unwrap()
    }

    #[test]
    fn chains_are_separated_by_black_lines() {
        let m = vec![vec![5.0; 10]; 10];
        let f = pae_figure(&[("rank_1".to_string(), &m[..])], &[4, 6]);
        let p = &f.panels[0];
        // Across row 8 (inside chain B) the line at residue 4 is black; within chain A not.
        let (x, y) = p.at(0.4, 0.85);
        let black = (x - 2..=x + 2).any(|x| f.pixel(x, y) == [0, 0, 0]);
        assert!(black, "no chain line at column 4");
        let (x, y) = p.at(0.2, 0.85);
        assert!(near(f.pixel(x, y), colour(bwr(5.0, PAE_MAX)), 2));
        let err = pae(&[("rank_1".to_string(), &m[..])], &[4, 5]).err().unwrap().to_string();
        assert!(err.contains("[4, 5]") && err.contains("10 residues"), "{err}");
    }

    #[test]
    fn plddt_lines_follow_the_values() {
        let high = [90.0; 20];
        let low: Vec<f64> = (0..20).map(|i| if i < 10 { 20.0 } else { 60.0 }).collect();
        let f = plddt(&[("rank_1".to_string(), &high[..]), ("rank_2".to_string(), &low[..])], &[20]).unwrap();
        assert_eq!((f.width, f.height), WIDE);
        let p = &f.panels[0];
        // The x range is padded by 5% of 19 positions each side; the y range is 0..100.
        let fx = |i: f64| (i + 0.95) / (19.0 + 1.9);
        let fy = |v: f64| 1.0 - v / 100.0;
        let has = |fxv: f64, v: f64, want: RGBColor| {
            let (x, y) = p.at(fxv, fy(v));
            (y - 3..=y + 3).any(|y| near(f.pixel(x, y), colour(want), 30))
        };
        assert!(has(fx(5.0), 90.0, TAB10[0]), "rank_1 at 90");
        assert!(has(fx(5.0), 20.0, TAB10[1]), "rank_2 at 20 on the left");
        assert!(has(fx(15.0), 60.0, TAB10[1]), "rank_2 at 60 on the right");
        assert!(!has(fx(15.0), 20.0, TAB10[1]), "rank_2 not at 20 on the right");
    }

    #[test]
    fn coverage_rows_are_grouped_and_sorted_and_coloured_by_identity() {
        // Query "ACDE" (classes 0, 4, 3, 6); a row identical in half, a row with gaps over its
        // second half (identity 1/4: one match among 4 positions), and a row of gaps only.
        let q = vec![0, 4, 3, 6];
        let half = vec![0, 4, 1, 1];
        let gapped = vec![0, 2, GAP, GAP];
        let none = vec![GAP; 4];
        let msa = vec![q.clone(), half, gapped, none];
        let cov = Coverage::new(&msa, &[4]).unwrap();
        let ids: Vec<f64> = cov.rows.iter().map(|r| (r.0 * 1e6).round() / 1e6).collect();
        assert_eq!(ids, [0.0, 0.25, 0.5, 1.0], "the gap-only row apart, then by identity, the query on top");
        assert_eq!(cov.group_starts, [1]);
        let f = coverage(&msa, &[4]).unwrap();
        assert_eq!((f.width, f.height), WIDE);
        let p = &f.panels[0];
        // Row r of 4 from the bottom; column c of 4.
        let at = |c: f64, r: f64| {
            let (x, y) = p.at((c + 0.5) / 4.0, 1.0 - (r + 0.5) / 4.0);
            f.pixel(x, y)
        };
        assert!(near(at(0.0, 3.0), colour(rainbow_r(1.0)), 2), "the query: {:?}", at(0.0, 3.0));
        assert!(near(at(2.0, 2.0), colour(rainbow_r(0.5)), 2));
        assert!(near(at(1.0, 1.0), colour(rainbow_r(0.25)), 2));
        assert_eq!(at(2.0, 1.0), [255, 255, 255], "a gap is white");
        assert_eq!(at(1.0, 0.0), [255, 255, 255], "so is a row of gaps");
        let err = coverage(&[q.clone(), vec![0, 1]], &[4]).err().unwrap().to_string();
        assert!(err.contains("row 1 has 2 columns"), "{err}");
    }

    #[test]
    fn text_is_drawn_with_the_shipped_font() {
        // The title's band above the chart has dark pixels: the font was found and rendered.
        let p = [50.0; 5];
        let f = plddt(&[("rank_1".to_string(), &p[..])], &[5]).unwrap();
        let dark =
            (0..40).flat_map(|y| (0..f.width as i32).map(move |x| (x, y))).filter(|&(x, y)| f.pixel(x, y)[0] < 100);
        assert!(dark.count() > 200, "no title drawn");
    }
}
