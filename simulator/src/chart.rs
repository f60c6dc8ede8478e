//! Line charts as SVG, drawn with `plotters`: a linear or logarithmic y axis fitted to the
//! data, a shaded band where a series has a spread, dashes and markers so that lines that
//! coincide stay apart, a legend and a title.
//!
//! The SVG backend writes text with fixed precision and no font files, so identical data gives
//! byte-identical files, which the simulator promises.

use plotters::coord::Shift;
use plotters::coord::ranged1d::{Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// How a line is drawn, on top of its colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stroke {
    /// A plain line.
    Solid,
    /// A dashed line in the series' colour: for a line another one may cover.
    Dashed,
    /// A thin black dashed line, drawn over the others: for a reference (an offered load)
    /// that other lines run along, which show through its gaps.
    Reference,
}

/// One line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's label.
    pub name: String,
    /// The points, in order of x.
    pub points: Vec<(f64, f64)>,
    /// The spread around each point, `(x, low, high)`, drawn as a shaded band: empty for none.
    pub band: Vec<(f64, f64, f64)>,
    /// How the line is drawn.
    pub stroke: Stroke,
    /// A marker on every point, so a line that another one covers still shows.
    pub markers: bool,
}

impl Series {
    /// A solid series named `name` through `points`, without markers or band.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
            band: Vec::new(),
            stroke: Stroke::Solid,
            markers: false,
        }
    }

    /// The same series with a marker on every point.
    pub fn with_markers(mut self) -> Self {
        self.markers = true;
        self
    }

    /// The same series, dashed.
    pub fn dashed(mut self) -> Self {
        self.stroke = Stroke::Dashed;
        self
    }

    /// The same series as a reference line: thin, black and dashed.
    pub fn reference(mut self) -> Self {
        self.stroke = Stroke::Reference;
        self
    }

    /// The same series with a shaded band from `low` to `high` at each `x`.
    pub fn with_band(mut self, band: Vec<(f64, f64, f64)>) -> Self {
        self.band = band;
        self
    }
}

/// A line chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// What the figure shows.
    pub title: String,
    /// The x axis label, with its unit.
    pub x_label: String,
    /// The y axis label, with its unit.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Draw each line as steps (for counts per time bucket) rather than straight segments.
    pub steps: bool,
    /// A logarithmic y axis, for values that span decades (every y must then be above zero).
    pub log_y: bool,
}

const WIDTH: u32 = 800;
const HEIGHT: u32 = 480;
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
];

impl Chart {
    /// The chart as an SVG document.
    ///
    /// # Panics
    ///
    /// If drawing fails, which with an in-memory SVG backend only a chart without points, or
    /// with a point at or below zero on a logarithmic axis, can make happen.
    pub fn to_svg(&self) -> String {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
            self.draw(&root)
                .unwrap_or_else(|e| panic!("cannot draw {:?}: {e}", self.title));
        }
        svg
    }

    fn draw(&self, root: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String> {
        let all = || {
            self.series.iter().flat_map(|s| {
                s.points
                    .iter()
                    .copied()
                    .chain(s.band.iter().flat_map(|&(x, lo, hi)| [(x, lo), (x, hi)]))
            })
        };
        let (mut x_min, mut x_max) = (f64::INFINITY, f64::NEG_INFINITY);
        let (mut y_min, mut y_max) = (f64::INFINITY, f64::NEG_INFINITY);
        for (x, y) in all() {
            x_min = x_min.min(x);
            x_max = x_max.max(x);
            y_min = y_min.min(y);
            y_max = y_max.max(y);
        }
        if !(x_min.is_finite() && y_min.is_finite()) {
            return Err("the chart has no points".into());
        }
        if x_max <= x_min {
            x_max = x_min + 1.0;
        }
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut builder = ChartBuilder::on(root);
        builder
            .caption(&self.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(72);
        if self.log_y {
            if y_min <= 0.0 {
                return Err(format!("a logarithmic axis cannot show {y_min}"));
            }
            // A little room below and above, on the logarithmic scale.
            let y = (y_min / 1.5..y_max * 1.5).log_scale();
            let mut chart = builder
                .build_cartesian_2d(x_min..x_max, y)
                .map_err(|e| e.to_string())?;
            self.plot(&mut chart)
        } else {
            let top = if y_max > 0.0 { y_max * 1.08 } else { 1.0 };
            let mut chart = builder
                .build_cartesian_2d(x_min..x_max, 0.0..top)
                .map_err(|e| e.to_string())?;
            self.plot(&mut chart)
        }
    }

    fn plot<'a, 'b: 'a, Y>(
        &self,
        chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, Y>>,
    ) -> Result<(), String>
    where
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        // One tick per point where there are few points (layers 1 to 4), else plotters' choice.
        let mut xs: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let x_ticks = if xs.len() <= 12 { xs.len() } else { 10 };
        chart
            .configure_mesh()
            .x_desc(self.x_label.as_str())
            .y_desc(self.y_label.as_str())
            .x_labels(x_ticks)
            .y_labels(8)
            .x_label_formatter(&|x| tidy(*x))
            .y_label_formatter(&|y| tidy(*y))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| e.to_string())?;
        // Dashed lines last, over the solid ones they may run along: they show through the
        // gaps. Each keeps the colour of its place in the list.
        let mut order: Vec<usize> = (0..self.series.len()).collect();
        order.sort_by_key(|&i| self.series[i].stroke != Stroke::Solid);
        for i in order {
            let series = &self.series[i];
            let colour = match series.stroke {
                Stroke::Reference => BLACK,
                _ => COLOURS[i % COLOURS.len()],
            };
            if !series.band.is_empty() {
                let mut outline: Vec<(f64, f64)> =
                    series.band.iter().map(|&(x, lo, _)| (x, lo)).collect();
                outline.extend(series.band.iter().rev().map(|&(x, _, hi)| (x, hi)));
                chart
                    .draw_series(std::iter::once(Polygon::new(outline, colour.mix(0.15))))
                    .map_err(|e| e.to_string())?;
            }
            let points = if self.steps {
                steps(&series.points)
            } else {
                series.points.clone()
            };
            let width = if series.stroke == Stroke::Reference {
                1
            } else {
                2
            };
            let style = colour.stroke_width(width);
            let legend = colour.stroke_width(width + 1);
            let name = series.name.as_str();
            match series.stroke {
                Stroke::Solid => {
                    chart
                        .draw_series(LineSeries::new(points, style))
                        .map_err(|e| e.to_string())?
                        .label(name)
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], legend));
                }
                Stroke::Dashed | Stroke::Reference => {
                    chart
                        .draw_series(DashedLineSeries::new(points, 8, 5, style))
                        .map_err(|e| e.to_string())?
                        .label(name)
                        .legend(move |(x, y)| {
                            plotters::element::DashedPathElement::new(
                                vec![(x, y), (x + 20, y)],
                                6,
                                3,
                                legend,
                            )
                        });
                }
            }
            // Markers get smaller, and alternate between filled and hollow, from one series to
            // the next, so a later series drawn over an earlier one leaves it in sight.
            let size = 7u32.saturating_sub(i as u32).max(3);
            if series.markers {
                chart
                    .draw_series(
                        series
                            .points
                            .iter()
                            .map(|&point| marker(i, point, size, colour)),
                    )
                    .map_err(|e| e.to_string())?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())
    }
}

/// Series `i`'s marker at `at`: a circle, a triangle or a cross, filled for even `i` and
/// hollow for odd.
fn marker<DB: DrawingBackend>(
    i: usize,
    at: (f64, f64),
    size: u32,
    colour: RGBColor,
) -> DynElement<'static, DB, (f64, f64)> {
    let style = if i.is_multiple_of(2) {
        colour.filled()
    } else {
        colour.stroke_width(2)
    };
    match i % 3 {
        0 => Circle::new(at, size, style).into_dyn(),
        1 => TriangleMarker::new(at, size, style).into_dyn(),
        _ => Cross::new(at, size, style).into_dyn(),
    }
}

/// A tick label: whole numbers without decimals, others with at most two.
fn tidy(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        let text = format!("{v:.2}");
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// The corners of a step line through `points`: each value holds until the next x.
fn steps(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len() * 2);
    for pair in points.windows(2) {
        let ((x0, y0), (x1, _)) = (pair[0], pair[1]);
        out.push((x0, y0));
        out.push((x1, y0));
    }
    out.extend(points.last().copied());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(log_y: bool) -> Chart {
        Chart {
            title: "Calls by strategy".into(),
            x_label: "clients (count)".into(),
            y_label: "calls (count)".into(),
            series: vec![
                Series::new("full jitter", vec![(10.0, 20.0), (100.0, 800.0)])
                    .with_band(vec![(10.0, 15.0, 25.0), (100.0, 700.0, 900.0)]),
                Series::new("no jitter", vec![(10.0, 30.0), (100.0, 5000.0)])
                    .with_markers()
                    .dashed(),
            ],
            steps: false,
            log_y,
        }
    }

    #[test]
    fn a_chart_has_its_title_labels_and_legend_and_repeats_byte_for_byte() {
        for log_y in [false, true] {
            let svg = chart(log_y).to_svg();
            assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
            for text in [
                "Calls by strategy",
                "clients (count)",
                "calls (count)",
                "full jitter",
                "no jitter",
            ] {
                assert!(svg.contains(text), "{text} missing (log_y {log_y})");
            }
            // The band is a polygon, and so is each of the second series' two triangles.
            assert!(svg.matches("<polygon").count() >= 3, "{svg}");
            assert_eq!(svg, chart(log_y).to_svg());
        }
    }

    #[test]
    fn steps_hold_each_value_until_the_next_point() {
        assert_eq!(
            steps(&[(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)]),
            [(0.0, 1.0), (1.0, 1.0), (1.0, 3.0), (2.0, 3.0), (2.0, 2.0)]
        );
        assert_eq!(steps(&[]), []);
    }

    #[test]
    fn a_chart_that_cannot_be_drawn_says_why() {
        let mut empty = chart(false);
        empty.series.clear();
        assert_eq!(empty.draw_to_error(), "the chart has no points");
        let mut zero = chart(true);
        zero.series[0].points[0].1 = 0.0;
        assert_eq!(zero.draw_to_error(), "a logarithmic axis cannot show 0");
    }

    impl Chart {
        fn draw_to_error(&self) -> String {
            let mut svg = String::new();
            let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
            self.draw(&root).unwrap_err()
        }
    }
}
