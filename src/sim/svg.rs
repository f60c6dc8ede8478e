//! Line charts as SVG text: axes with units, ticks, a legend and a title.
//!
//! Written by hand rather than with a plotting library: a chart here is a few dozen elements,
//! and plain string formatting with fixed precision gives byte-identical files for identical
//! data, which the simulator promises.

use std::fmt::Write as _;

/// One line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's label.
    pub name: String,
    /// The points, in order of x.
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// A series named `name` through `points`.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
        }
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
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

impl Chart {
    /// The chart as an SVG document.
    pub fn to_svg(&self) -> String {
        let points = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x_max, mut y_max) = (0.0f64, 0.0f64);
        let mut x_min = f64::INFINITY;
        for &(x, y) in points {
            x_min = x_min.min(x);
            x_max = x_max.max(x);
            y_max = y_max.max(y);
        }
        if !x_min.is_finite() {
            x_min = 0.0;
        }
        // The x axis starts at the step below the first point: zero for most charts, close to
        // the data for a window such as 1.95 s to 2.15 s.
        let (x_step, _) = nice_axis(x_max - x_min);
        let x_min = (x_min / x_step).floor() * x_step;
        let x_top = ((x_max - x_min) / x_step).ceil().max(1.0) * x_step;
        let (y_step, y_top) = nice_axis(y_max);
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let sx = |x: f64| LEFT + (x - x_min) / x_top * plot_w;
        let sy = |y: f64| TOP + plot_h - y / y_top * plot_h;

        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="28" font-size="16" text-anchor="middle">{}</text>"#,
            (LEFT + WIDTH - RIGHT) / 2.0,
            escape(&self.title)
        );
        // Grid and ticks.
        let mut tick = 0.0;
        while tick <= y_top + y_step / 2.0 {
            let y = sy(tick);
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                y + 4.0,
                fmt_tick(tick, y_step)
            );
            tick += y_step;
        }
        let mut tick = 0.0;
        while tick <= x_top + x_step / 2.0 {
            let x = sx(x_min + tick);
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#999"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + plot_h,
                TOP + plot_h + 5.0,
                TOP + plot_h + 19.0,
                fmt_tick(x_min + tick, x_step)
            );
            tick += x_step;
        }
        // Axes and their labels.
        let _ = writeln!(
            svg,
            r#"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="black"/><line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
            TOP + plot_h,
            TOP + plot_h,
            LEFT + plot_w,
            TOP + plot_h
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + plot_w / 2.0,
            HEIGHT - 18.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            svg,
            r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
            TOP + plot_h / 2.0,
            TOP + plot_h / 2.0,
            escape(&self.y_label)
        );
        // Lines and legend.
        for (i, series) in self.series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let mut path = String::new();
            let mut last_y = None;
            for (j, &(x, y)) in series.points.iter().enumerate() {
                let (px, py) = (sx(x), sy(y));
                if j == 0 {
                    let _ = write!(path, "M{px:.1},{py:.1}");
                } else {
                    if let (true, Some(prev)) = (self.steps, last_y) {
                        let _ = write!(path, " L{px:.1},{prev:.1}");
                    }
                    let _ = write!(path, " L{px:.1},{py:.1}");
                }
                last_y = Some(py);
            }
            let _ = writeln!(
                svg,
                r#"<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"/>"#
            );
            let ly = TOP + 14.0 + i as f64 * 20.0;
            let lx = WIDTH - RIGHT + 14.0;
            let _ = writeln!(
                svg,
                r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
                lx + 22.0,
                lx + 28.0,
                ly + 4.0,
                escape(&series.name)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// A tick step of 1, 2 or 5 times a power of ten, and the axis top it gives for `span`.
fn nice_axis(span: f64) -> (f64, f64) {
    if !(span.is_finite() && span > 0.0) {
        return (1.0, 1.0);
    }
    let raw = span / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    (step, (span / step).ceil() * step)
}

fn fmt_tick(value: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{value:.0}")
    } else {
        let decimals = (-step.log10().floor()) as usize;
        format!("{value:.decimals$}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_use_round_steps() {
        assert_eq!(nice_axis(100.0), (20.0, 100.0));
        assert_eq!(nice_axis(7.3), (2.0, 8.0));
        assert_eq!(nice_axis(0.42), (0.1, 0.5));
        assert_eq!(nice_axis(0.0), (1.0, 1.0));
    }

    #[test]
    fn a_chart_has_its_title_labels_and_legend() {
        let chart = Chart {
            title: "Load <at> the server".into(),
            x_label: "time (s)".into(),
            y_label: "attempts per second".into(),
            series: vec![
                Series::new("with budget", vec![(0.0, 1.0), (1.0, 3.0)]),
                Series::new("without", vec![(0.0, 2.0), (1.0, 9.0)]),
            ],
            steps: false,
        };
        let svg = chart.to_svg();
        assert!(svg.starts_with("<svg "));
        assert!(svg.contains("Load &lt;at&gt; the server"));
        assert!(svg.contains(">time (s)</text>"));
        assert!(svg.contains(">attempts per second</text>"));
        assert!(svg.contains(">with budget</text>") && svg.contains(">without</text>"));
        assert_eq!(svg.matches("<path ").count(), 2);
        assert_eq!(svg, chart.to_svg());
    }
}
