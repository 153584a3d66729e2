//! `--plot`: a fleet run's timeline, and a comparison of policies (`sim
//! compare`, each case of `sim suite`), as a picture.
//!
//! A figure is drawn with `plotters` into memory and written in one go, so
//! a failed write names the file and leaves nothing half drawn. Text is
//! measured (and, in a PNG, drawn) with the Noto Sans compiled into the
//! binary, so a machine with no fonts installed plots the same image; an
//! SVG asks the viewer for `sans-serif`, which every viewer has.

use std::path::PathBuf;
use std::sync::Once;

use anyhow::{anyhow, Context};
use hangar_sim::compare::Comparison;
use hangar_sim::fleet::FleetReport;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

/// Where `--plot` writes, and in which format: known from the file's
/// extension when the flag is parsed, before a simulation runs.
#[derive(Debug, Clone)]
pub struct PlotFile {
    path: PathBuf,
    format: Format,
}

#[derive(Debug, Clone, Copy)]
enum Format {
    Svg,
    Png,
}

impl PlotFile {
    /// clap's parser for `--plot FILE`: a `.svg` or `.png` file, in either
    /// case.
    pub fn parse(arg: &str) -> Result<Self, String> {
        let path = PathBuf::from(arg);
        let extension = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        let format = match extension.as_deref() {
            Some("svg") => Format::Svg,
            Some("png") => Format::Png,
            _ => return Err(format!("{arg}: a plot is written as .svg or .png")),
        };
        Ok(PlotFile { path, format })
    }
}

/// Draws load, replicas per model and TTFT p99 over the simulated time of
/// `report` (which needs a timeline: `FleetOptions::sample_ms`) to `file`.
pub fn timeline(report: &FleetReport, file: &PlotFile) -> anyhow::Result<()> {
    save(&Timeline(report), file)
}

/// Draws a comparison's runs at their GPU-hours (x) against their SLO
/// attainment (y): each peer's frontier as a line through its settings,
/// `hangar` as a larger point, and the hindsight bound (at 99 % and for
/// every request) as dashed vertical lines, to `file`.
pub fn comparison(comparison: &Comparison, title: &str, file: &PlotFile) -> anyhow::Result<()> {
    save(&Frontiers { comparison, title }, file)
}

/// The family of every text in a figure, registered with the embedded
/// font.
const FAMILY: &str = "sans-serif";

/// Tableau's ten colours, one per model or policy (cycling past ten):
/// told apart at a glance, and none too pale on white.
const COLORS: [RGBColor; 10] = [
    RGBColor(78, 121, 167),
    RGBColor(242, 142, 43),
    RGBColor(225, 87, 89),
    RGBColor(118, 183, 178),
    RGBColor(89, 161, 79),
    RGBColor(237, 201, 72),
    RGBColor(176, 122, 161),
    RGBColor(255, 157, 167),
    RGBColor(156, 117, 95),
    RGBColor(186, 176, 172),
];

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// An axis label: at most two figures after the point, and no trailing
/// zeros (`0.2`, `1`, not `0.20`, `1.0`).
fn tick(v: &f64) -> String {
    let text = format!("{v:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// A chart over the run's time (x, seconds) and `Y`.
type Panel<'a, DB, Y> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>;

/// The series' names, in a box at the top right.
fn legend<'a, DB: DrawingBackend + 'a, Y: Ranged>(chart: &mut Panel<'a, DB, Y>) -> DrawResult<DB> {
    chart
        .configure_series_labels()
        .label_font((FAMILY, 12))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// A figure, drawable on any plotters backend.
trait Figure {
    /// Width and height, pixels.
    fn size(&self) -> (u32, u32);

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB>;
}

fn save(figure: &impl Figure, file: &PlotFile) -> anyhow::Result<()> {
    static FONT: Once = Once::new();
    FONT.call_once(|| {
        plotters::style::register_font(FAMILY, FontStyle::Normal, ttf_noto_sans::REGULAR)
            .ok()
            .expect("the embedded Noto Sans parses");
    });
    let size = figure.size();
    let path = file.path.display();
    let bytes = match file.format {
        Format::Svg => {
            let mut svg = String::new();
            render(figure, SVGBackend::with_string(&mut svg, size))
                .map_err(|e| anyhow!("cannot draw {path}: {e}"))?;
            svg.into_bytes()
        }
        Format::Png => {
            let mut rgb = vec![0; 3 * size.0 as usize * size.1 as usize];
            render(figure, BitMapBackend::with_buffer(&mut rgb, size))
                .map_err(|e| anyhow!("cannot draw {path}: {e}"))?;
            encode_png(&rgb, size).with_context(|| format!("cannot encode {path}"))?
        }
    };
    std::fs::write(&file.path, bytes).with_context(|| format!("cannot write the plot {path}"))
}

fn render<DB: DrawingBackend>(figure: &impl Figure, backend: DB) -> DrawResult<DB> {
    let root = backend.into_drawing_area();
    root.fill(&WHITE)?;
    figure.draw(&root)?;
    root.present()
}

fn encode_png(rgb: &[u8], (w, h): (u32, u32)) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(out)
}

/// Three panels over one time axis: load, replicas per model, TTFT p99.
struct Timeline<'a>(&'a FleetReport);

impl Timeline<'_> {
    /// Each sample's window, seconds: to the next sample, the last one to
    /// the end of the run.
    fn windows(&self) -> Vec<(f64, f64)> {
        let r = self.0;
        let ends = r.timeline.iter().skip(1).map(|s| s.t_s).chain([r.duration_s]);
        r.timeline.iter().zip(ends).map(|(s, end)| (s.t_s, end.max(s.t_s))).collect()
    }

    /// `value` of each window held across it, as runs of a step line
    /// broken where a window has no value.
    fn steps(&self, value: impl Fn(usize, f64) -> Option<f64>) -> Vec<Vec<(f64, f64)>> {
        let mut runs = vec![Vec::new()];
        for (i, (start, end)) in self.windows().into_iter().enumerate() {
            match value(i, end - start) {
                Some(v) => runs.last_mut().expect("one run at least").extend([(start, v), (end, v)]),
                None if runs.last().is_some_and(|r| !r.is_empty()) => runs.push(Vec::new()),
                None => {}
            }
        }
        runs.retain(|r| !r.is_empty());
        runs
    }

    fn end_s(&self) -> f64 {
        self.0.duration_s.max(1.0)
    }

    /// A panel over the run's time, `y` up its left side: captioned and
    /// labelled as its siblings are.
    fn panel<'a, DB, Y>(
        &self,
        area: &'a DrawingArea<DB, Shift>,
        caption: &str,
        y: Y,
        y_desc: &str,
    ) -> Result<Panel<'a, DB, Y::CoordDescType>, DrawingAreaErrorKind<DB::ErrorType>>
    where
        DB: DrawingBackend,
        Y: AsRangedCoord<Value = f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let mut chart = ChartBuilder::on(area)
            .caption(caption, (FAMILY, 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..self.end_s(), y)?;
        chart
            .configure_mesh()
            .x_desc("simulated time, s")
            .y_desc(y_desc)
            .label_style((FAMILY, 12))
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .draw()?;
        Ok(chart)
    }

    fn load<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let timeline = &self.0.timeline;
        let runs = self.steps(|i, secs| (secs > 0.0).then(|| timeline[i].arrivals as f64 / secs));
        let top = runs.iter().flatten().map(|p| p.1).fold(1.0, f64::max) * 1.1;
        let mut chart =
            self.panel(area, "load: arrivals per second, all models", 0.0..top, "requests / s")?;
        for run in runs {
            chart.draw_series(LineSeries::new(run, BLUE.stroke_width(1)))?;
        }
        Ok(())
    }

    fn replicas<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let r = self.0;
        let top = r.timeline.iter().flat_map(|s| s.desired.iter().chain(&s.hot)).copied().max().unwrap_or(0);
        let caption = "replicas per model (solid: hot, dashed: wanted)";
        let mut chart = self.panel(area, caption, 0.0..(top as f64 + 1.0), "replicas")?;
        for (m, model) in r.models.iter().enumerate() {
            let color = color(m);
            for (k, run) in self.steps(|i, _| Some(r.timeline[i].hot[m] as f64)).into_iter().enumerate() {
                let series = chart.draw_series(LineSeries::new(run, color.stroke_width(2)))?;
                if k == 0 {
                    series
                        .label(model.model.as_str())
                        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
                }
            }
            for run in self.steps(|i, _| Some(r.timeline[i].desired[m] as f64)) {
                chart.draw_series(DashedLineSeries::new(run, 6, 4, color.stroke_width(1)))?;
            }
        }
        legend(&mut chart)
    }

    fn ttft<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let r = self.0;
        let runs = self.steps(|i, _| r.timeline[i].ttft_p99_ms);
        let mut objectives: Vec<f64> =
            r.models.iter().map(|m| m.slo_ttft_ms).filter(|v| v.is_finite() && *v > 0.0).collect();
        objectives.sort_by(f64::total_cmp);
        objectives.dedup();
        let values = || runs.iter().flatten().map(|p| p.1).chain(objectives.iter().copied());
        let low = values().fold(f64::INFINITY, f64::min).clamp(1.0, 1e3);
        let high = values().fold(low * 10.0, f64::max);
        let caption = "TTFT p99 per window, all models (log scale)";
        let mut chart = self.panel(area, caption, (low / 1.5..high * 1.5).log_scale(), "ms")?;
        for run in runs {
            chart.draw_series(LineSeries::new(run, RED.stroke_width(1)))?;
        }
        for slo in objectives {
            chart
                .draw_series(DashedLineSeries::new([(0.0, slo), (self.end_s(), slo)], 6, 4, BLACK.into()))?
                .label(format!("objective {slo:.0} ms"))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
        }
        legend(&mut chart)
    }
}

impl Figure for Timeline<'_> {
    fn size(&self) -> (u32, u32) {
        (1000, 900)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let t = &self.0.total;
        let title = format!(
            "{}: {} requests, {:.1} % within the TTFT objective, {:.2} GPU-hours",
            self.0.trace,
            t.requests,
            t.slo_attainment * 100.0,
            t.gpu_seconds.total / 3600.0
        );
        let root = root.titled(&title, (FAMILY, 18))?;
        let panels = root.split_evenly((3, 1));
        self.load(&panels[0])?;
        self.replicas(&panels[1])?;
        self.ttft(&panels[2])
    }
}

/// A comparison: every run, the peers' frontiers and the bound.
struct Frontiers<'a> {
    comparison: &'a Comparison,
    title: &'a str,
}

impl Figure for Frontiers<'_> {
    fn size(&self) -> (u32, u32) {
        (900, 600)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let c = self.comparison;
        let bounds: Vec<(f64, &str)> = c
            .bound
            .iter()
            .flat_map(|b| [(b.gpu_hours, "bound, 99 %"), (Some(b.gpu_hours_all), "bound, every request")])
            .filter_map(|(v, name)| v.filter(|v| v.is_finite()).map(|v| (v, name)))
            .collect();
        let right = c
            .runs
            .iter()
            .map(|r| r.gpu_hours)
            .chain(bounds.iter().map(|b| b.0))
            .fold(0.0, f64::max)
            .max(1e-3)
            * 1.2;
        let bottom = (c.runs.iter().map(|r| r.total.slo_attainment * 100.0).fold(100.0, f64::min) - 5.0)
            .max(0.0)
            .floor();
        let top = 100.0 + (100.0 - bottom) * 0.05;
        let root = root.titled(self.title, (FAMILY, 16))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "GPU-hours against SLO attainment: every run, the peers' frontiers, the hindsight bound",
                (FAMILY, 14),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..right, bottom..top)?;
        // Enough decimals that ticks of a small run differ (0.005, 0.010).
        let decimals = (1 - right.log10().floor() as i32).max(0) as usize;
        let x_tick = |v: &f64| format!("{v:.decimals$}");
        chart
            .configure_mesh()
            .x_desc("GPU-hours")
            .y_desc("requests within the TTFT objective, %")
            .label_style((FAMILY, 12))
            .x_label_formatter(&x_tick)
            .y_label_formatter(&tick)
            .draw()?;
        for (i, (x, name)) in bounds.iter().enumerate() {
            let style = if i == 0 { BLACK.stroke_width(2) } else { BLACK.stroke_width(1) };
            chart
                .draw_series(DashedLineSeries::new([(*x, bottom), (*x, top)], 6, 4, style))?
                .label(format!("{name}: {x:.3} GPU-h"))
                .legend(move |(lx, ly)| PathElement::new([(lx, ly), (lx + 20, ly)], style));
        }
        // One colour per policy, in the order the runs name them.
        let mut families: Vec<&str> = Vec::new();
        for r in &c.runs {
            if !families.contains(&r.family.as_str()) {
                families.push(&r.family);
            }
        }
        for (i, family) in families.into_iter().enumerate() {
            let color = color(i);
            if let Some(f) = c.frontiers.iter().find(|f| f.family == family) {
                let line: Vec<(f64, f64)> =
                    f.points.iter().map(|p| (p.gpu_hours, p.attainment * 100.0)).collect();
                chart.draw_series(LineSeries::new(line, color.stroke_width(1)))?;
            }
            let radius = if family == "hangar" { 7 } else { 4 };
            chart
                .draw_series(c.runs.iter().filter(|r| r.family == family).map(|r| {
                    EmptyElement::at((r.gpu_hours, r.total.slo_attainment * 100.0))
                        + Circle::new((0, 0), radius, color.filled())
                        + Text::new(r.label.clone(), (8, -14), (FAMILY, 11))
                }))?
                .label(family)
                .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
        }
        chart
            .configure_series_labels()
            .label_font((FAMILY, 12))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
    }
}
