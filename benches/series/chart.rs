//! Plain SVG charts for the series: grouped bars on a linear or log axis, and log-log lines in
//! panels side by side. Values are written on the bars and points, so the picture reads
//! without tooltips.

use std::fmt::Write as _;

const PALETTE: [&str; 10] = [
    "#1b6ca8", "#9bc1e0", "#f28e2b", "#ffbe7d", "#59a14f", "#8cd17d", "#e15759", "#b07aa1",
    "#9c755f", "#76b7b2",
];

/// A chart of a short run, marked as such in its top right corner.
pub(crate) fn mark_short(svg: &str) -> String {
    let width: f64 = svg
        .split_once(r#"width=""#)
        .and_then(|(_, rest)| rest.split('"').next()?.parse().ok())
        .unwrap_or(400.0);
    svg.replacen(
        "</svg>",
        &format!(
            r##"<text x="{:.0}" y="20" text-anchor="end" fill="#c00">a short run: not for publishing</text></svg>"##,
            width - 10.0
        ),
        1,
    )
}

/// One group of bars: its label (two lines) and a value per series (`None`: not measured).
pub(crate) struct Group {
    pub(crate) label: String,
    pub(crate) sub: String,
    pub(crate) bars: Vec<(String, Option<f64>)>,
}

/// A number in three significant digits at most, `k` from ten thousand.
pub(crate) fn num(v: f64) -> String {
    if v >= 10_000.0 {
        let k = v / 1000.0;
        if k >= 100.0 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k").replace(".0k", "k")
        }
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        trim(format!("{v:.1}"))
    } else if v >= 1.0 {
        trim(format!("{v:.2}"))
    } else {
        trim(format!("{v:.3}"))
    }
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A value axis: pixel of a value, and the ticks.
struct Axis {
    log: bool,
    lo: f64,
    hi: f64,
    top: f64,
    height: f64,
}

impl Axis {
    fn new(values: &[f64], log: bool, top: f64, height: f64) -> Axis {
        let (min, max) = values
            .iter()
            .fold((f64::INFINITY, 0f64), |(a, b), v| (a.min(*v), b.max(*v)));
        let (min, max) = if values.is_empty() {
            (1.0, 10.0)
        } else {
            (min, max)
        };
        if log {
            let lo = min.max(1e-6).log10().floor();
            let hi = (max.max(1e-6) * 1.3).log10().ceil().max(lo + 1.0);
            Axis {
                log,
                lo,
                hi,
                top,
                height,
            }
        } else {
            let step = nice(max.max(1e-9) * 1.15 / 5.0);
            Axis {
                log,
                lo: 0.0,
                hi: (max.max(1e-9) * 1.15 / step).ceil() * step,
                top,
                height,
            }
        }
    }

    fn y(&self, v: f64) -> f64 {
        let f = if self.log {
            (v.max(10f64.powf(self.lo)).log10() - self.lo) / (self.hi - self.lo)
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        self.top + self.height * (1.0 - f.clamp(0.0, 1.0))
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let decades = (self.hi - self.lo) as i32;
            let mut t = Vec::new();
            for e in self.lo as i32..=self.hi as i32 {
                let base = 10f64.powi(e);
                t.push(base);
                if decades <= 3 && e < self.hi as i32 {
                    t.extend([2.0 * base, 5.0 * base]);
                }
            }
            t
        } else {
            let step = nice(self.hi / 5.0);
            (0..)
                .map(|i| i as f64 * step)
                .take_while(|v| *v <= self.hi * 1.0001)
                .collect()
        }
    }

    /// Horizontal grid lines and their labels from `x0` to `x1`.
    fn grid(&self, svg: &mut String, x0: f64, x1: f64, labels: bool) {
        for t in self.ticks() {
            let y = self.y(t);
            let _ = write!(
                svg,
                r##"<line x1="{x0:.1}" x2="{x1:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#e3e3e3"/>"##
            );
            if labels {
                let _ = write!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                    x0 - 5.0,
                    y + 4.0,
                    num(t)
                );
            }
        }
        let _ = write!(
            svg,
            r##"<line x1="{x0:.1}" x2="{x0:.1}" y1="{:.1}" y2="{:.1}" stroke="#888"/><line x1="{x0:.1}" x2="{x1:.1}" y1="{:.1}" y2="{:.1}" stroke="#888"/>"##,
            self.top,
            self.top + self.height,
            self.top + self.height,
            self.top + self.height
        );
    }
}

/// 1, 2 or 5 times a power of ten, at least `v`.
fn nice(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= v)
        .unwrap_or(10.0 * p)
}

fn open(svg: &mut String, width: f64, height: f64, title: &str) {
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(
        svg,
        r#"<text x="12" y="20" font-size="13" font-weight="bold">{}</text>"#,
        escape(title)
    );
}

fn y_label(svg: &mut String, x: f64, y: f64, label: &str) {
    let _ = write!(
        svg,
        r#"<text transform="translate({x:.1},{y:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        escape(label)
    );
}

fn legend(svg: &mut String, x: f64, y: f64, series: &[String]) {
    for (i, s) in series.iter().enumerate() {
        let ly = y + 16.0 * i as f64;
        let _ = write!(
            svg,
            r#"<rect x="{x:.1}" y="{ly:.1}" width="11" height="11" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            PALETTE[i % PALETTE.len()],
            x + 16.0,
            ly + 9.5,
            escape(s)
        );
    }
}

/// Grouped bars: one group per entry of `groups`, one colour per series (in order of first
/// appearance), the value written above each bar.
pub(crate) fn bars(title: &str, unit: &str, log: bool, groups: &[Group]) -> String {
    let mut series: Vec<String> = Vec::new();
    for g in groups {
        for (s, _) in &g.bars {
            if !series.contains(s) {
                series.push(s.clone());
            }
        }
    }
    let values: Vec<f64> = groups
        .iter()
        .flat_map(|g| g.bars.iter().filter_map(|b| b.1))
        .filter(|v| !log || *v > 0.0)
        .collect();
    let (left, top, bar_w, gap, plot_h) = (78.0, 44.0, 18.0, 30.0, 300.0);
    let axis = Axis::new(&values, log, top, plot_h);
    // Wide enough for its label too (about 6.5 px a character at 11 px).
    let group_w = |g: &Group| {
        (g.bars.len() as f64 * bar_w)
            .max(6.5 * g.label.chars().count().max(g.sub.chars().count()) as f64 - gap + 8.0)
            .max(60.0)
    };
    let plot_w: f64 = groups.iter().map(|g| group_w(g) + gap).sum::<f64>() + gap / 2.0;
    let legend_w = 30.0 + 6.5 * series.iter().map(|s| s.len()).max().unwrap_or(0) as f64;
    let width = left + plot_w + legend_w;
    let height = top + plot_h + 62.0;
    let mut svg = String::new();
    open(&mut svg, width, height, title);
    axis.grid(&mut svg, left, left + plot_w, true);
    y_label(
        &mut svg,
        18.0,
        top + plot_h / 2.0,
        &format!("{unit}{}", if log { " (log scale)" } else { "" }),
    );
    let base = top + plot_h;
    let mut x = left + gap / 2.0 + 4.0;
    for g in groups {
        let w = group_w(g);
        let mut bx = x + (w - g.bars.len() as f64 * bar_w) / 2.0;
        for (s, v) in &g.bars {
            let i = series.iter().position(|x| x == s).unwrap_or(0);
            let cx = bx + (bar_w - 2.0) / 2.0;
            match v {
                Some(v) if !log || *v > 0.0 => {
                    let by = axis.y(*v);
                    let _ = write!(
                        svg,
                        r#"<rect x="{bx:.1}" y="{by:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{} {}, {}: {}</title></rect>"#,
                        bar_w - 2.0,
                        (base - by).max(0.5),
                        PALETTE[i % PALETTE.len()],
                        escape(&g.label),
                        escape(&g.sub),
                        escape(s),
                        num(*v)
                    );
                    let _ = write!(
                        svg,
                        r#"<text transform="translate({:.1},{:.1}) rotate(-90)" font-size="9">{}</text>"#,
                        cx + 3.0,
                        by - 3.0,
                        num(*v)
                    );
                }
                _ => {
                    let _ = write!(
                        svg,
                        r##"<text transform="translate({:.1},{:.1}) rotate(-90)" font-size="9" fill="#888">not run</text>"##,
                        cx + 3.0,
                        base - 3.0
                    );
                }
            }
            bx += bar_w;
        }
        let mid = x + w / 2.0;
        let _ = write!(
            svg,
            r##"<text x="{mid:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="{mid:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            base + 16.0,
            escape(&g.label),
            base + 30.0,
            escape(&g.sub)
        );
        x += w + gap;
    }
    legend(&mut svg, left + plot_w + 14.0, top, &series);
    svg.push_str("</svg>\n");
    svg
}

/// The colour of a line: dblock's two in blues, the peers apart, Redis grey; others from the
/// palette.
fn line_colour(label: &str, i: usize) -> &'static str {
    if label.contains("coalesce(false)") {
        "#9bc1e0"
    } else if label.starts_with("dblock") {
        "#1b6ca8"
    } else if label.starts_with("pgbench") {
        "#59a14f"
    } else if label.starts_with("Redis") {
        "#888888"
    } else if label.contains("advisory") || label.contains("GET_LOCK") {
        "#f28e2b"
    } else {
        PALETTE[i % PALETTE.len()]
    }
}

/// One panel of a line chart: its title and its series' points (x, y).
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Panels side by side on log-log axes, the y axis shared; x ticks at `x_ticks`; one colour
/// per series label across the panels.
pub(crate) fn lines(
    title: &str,
    x_label: &str,
    y_label_text: &str,
    x_ticks: &[f64],
    panels: &[Panel],
) -> String {
    let mut series: Vec<String> = Vec::new();
    for p in panels {
        for (s, _) in &p.series {
            if !series.contains(s) {
                series.push(s.clone());
            }
        }
    }
    let values: Vec<f64> = panels
        .iter()
        .flat_map(|p| p.series.iter().flat_map(|s| s.1.iter().map(|pt| pt.1)))
        .filter(|v| *v > 0.0)
        .collect();
    let (left, top, panel_w, panel_gap, plot_h) = (78.0, 60.0, 250.0, 36.0, 300.0);
    let axis = Axis::new(&values, true, top, plot_h);
    let x_lo = x_ticks
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .log10();
    let x_hi = x_ticks.iter().copied().fold(0.0, f64::max).log10();
    let n = panels.len().max(1) as f64;
    let width = left + n * (panel_w + panel_gap) + 10.0;
    let legend_rows = series.len().div_ceil(2) as f64;
    let height = top + plot_h + 56.0 + 16.0 * legend_rows + 10.0;
    let mut svg = String::new();
    open(&mut svg, width, height, title);
    y_label(&mut svg, 18.0, top + plot_h / 2.0, y_label_text);
    for (pi, p) in panels.iter().enumerate() {
        let x0 = left + pi as f64 * (panel_w + panel_gap);
        let x1 = x0 + panel_w;
        let px =
            |x: f64| x0 + 10.0 + (x.log10() - x_lo) / (x_hi - x_lo).max(1e-9) * (panel_w - 20.0);
        axis.grid(&mut svg, x0, x1, pi == 0);
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-weight="bold">{}</text>"#,
            (x0 + x1) / 2.0,
            top - 8.0,
            escape(&p.title)
        );
        for t in x_ticks {
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                px(*t),
                top + plot_h + 15.0,
                num(*t)
            );
        }
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            (x0 + x1) / 2.0,
            top + plot_h + 31.0,
            escape(x_label)
        );
        for (s, points) in &p.series {
            let i = series.iter().position(|x| x == s).unwrap_or(0);
            let colour = line_colour(s, i);
            let pts: Vec<String> = points
                .iter()
                .filter(|pt| pt.1 > 0.0)
                .map(|(x, y)| format!("{:.1},{:.1}", px(*x), axis.y(*y)))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="1.6"/>"#,
                pts.join(" ")
            );
            for (x, y) in points.iter().filter(|pt| pt.1 > 0.0) {
                let _ = write!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"><title>{}, {}: {} at {}</title></circle>"#,
                    px(*x),
                    axis.y(*y),
                    escape(&p.title),
                    escape(s),
                    num(*y),
                    num(*x)
                );
            }
        }
    }
    // The legend in two columns under the panels.
    let ly = top + plot_h + 48.0;
    let col_w = (width - left) / 2.0;
    for (i, s) in series.iter().enumerate() {
        let (cx, cy) = (left + (i % 2) as f64 * col_w, ly + 16.0 * (i / 2) as f64);
        let _ = write!(
            svg,
            r#"<rect x="{cx:.1}" y="{cy:.1}" width="11" height="11" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            line_colour(s, i),
            cx + 16.0,
            cy + 9.5,
            escape(s)
        );
    }
    svg.push_str("</svg>\n");
    svg
}
