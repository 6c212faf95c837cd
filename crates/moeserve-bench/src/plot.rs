//! The "sweet spot" chart: latency against throughput over the concurrency levels, one series
//! per result file, as a self-contained SVG. Two panels share the x axis (output tokens/s): TPOT
//! and TTFT, each with its p50 (solid, points labelled with their concurrency) and p99 (dashed).
//! Where a curve bends upward, more concurrency buys little throughput for much latency.

use std::fmt::Write;

use crate::report::BenchResult;
use crate::stats::LatencySummary;

/// Colours of successive series (colour-blind-safe, Okabe–Ito).
const COLOURS: [&str; 6] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
];

const WIDTH: f64 = 980.0;
const HEIGHT: f64 = 440.0;
const PANEL_WIDTH: f64 = 400.0;
const PANEL_HEIGHT: f64 = 300.0;
const TOP: f64 = 60.0;
const LEFTS: [f64; 2] = [80.0, 560.0];

/// One series: a result file and its legend label.
pub struct Series<'a> {
    pub label: String,
    pub result: &'a BenchResult,
}

/// Which latency a panel shows.
struct Panel {
    title: &'static str,
    latency: fn(&crate::report::LevelReport) -> &LatencySummary,
}

const PANELS: [Panel; 2] = [
    Panel {
        title: "TPOT (ms)",
        latency: |l| &l.tpot_ms,
    },
    Panel {
        title: "TTFT (ms)",
        latency: |l| &l.ttft_ms,
    },
];

/// The SVG document of `series`.
pub fn latency_throughput_svg(series: &[Series]) -> String {
    let x_max = nice_max(
        series
            .iter()
            .flat_map(|s| s.result.levels.iter().map(|l| l.output_throughput))
            .fold(0.0, f64::max),
    );
    let mut svg = String::new();
    writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    )
    .expect("writing to a String");
    svg.push_str(r#"<rect width="100%" height="100%" fill="white"/>"#);
    svg.push('\n');
    let title = match series {
        [one] => format!(
            "{} — prompt {:.0}, output {:.0} tokens",
            one.result.setup.model, one.result.setup.prompt_len, one.result.setup.output_len
        ),
        _ => "latency vs throughput".to_string(),
    };
    text(&mut svg, WIDTH / 2.0, 24.0, "middle", 15.0, &title);
    for (panel, left) in PANELS.iter().zip(LEFTS) {
        let y_max = nice_max(
            series
                .iter()
                .flat_map(|s| s.result.levels.iter().map(|l| (panel.latency)(l).p99))
                .fold(0.0, f64::max),
        );
        let frame = Frame { left, x_max, y_max };
        frame.axes(&mut svg, panel.title);
        for (i, s) in series.iter().enumerate() {
            frame.series(&mut svg, s, panel, COLOURS[i % COLOURS.len()]);
        }
    }
    legend(&mut svg, series);
    svg.push_str("</svg>\n");
    svg
}

/// A panel's placement and scales (both axes start at 0).
struct Frame {
    left: f64,
    x_max: f64,
    y_max: f64,
}

impl Frame {
    fn x(&self, v: f64) -> f64 {
        self.left + v / self.x_max * PANEL_WIDTH
    }

    fn y(&self, v: f64) -> f64 {
        TOP + PANEL_HEIGHT - v / self.y_max * PANEL_HEIGHT
    }

    fn axes(&self, svg: &mut String, y_title: &str) {
        let bottom = TOP + PANEL_HEIGHT;
        for tick in ticks(self.x_max) {
            let x = self.x(tick);
            line(svg, (x, TOP), (x, bottom), "#e5e5e5");
            text(svg, x, bottom + 16.0, "middle", 11.0, &format_tick(tick));
        }
        for tick in ticks(self.y_max) {
            let y = self.y(tick);
            line(svg, (self.left, y), (self.left + PANEL_WIDTH, y), "#e5e5e5");
            text(
                svg,
                self.left - 6.0,
                y + 4.0,
                "end",
                11.0,
                &format_tick(tick),
            );
        }
        line(
            svg,
            (self.left, bottom),
            (self.left + PANEL_WIDTH, bottom),
            "#333",
        );
        line(svg, (self.left, TOP), (self.left, bottom), "#333");
        let mid = self.left + PANEL_WIDTH / 2.0;
        text(svg, mid, bottom + 36.0, "middle", 12.0, "output tokens/s");
        text(svg, mid, TOP - 10.0, "middle", 13.0, y_title);
    }

    fn series(&self, svg: &mut String, s: &Series, panel: &Panel, colour: &str) {
        let mut levels: Vec<_> = s.result.levels.iter().filter(|l| l.completed > 0).collect();
        levels.sort_by_key(|l| l.concurrency);
        let points = |pick: fn(&LatencySummary) -> f64| -> String {
            levels
                .iter()
                .map(|l| {
                    let v = pick((panel.latency)(l));
                    format!("{:.1},{:.1}", self.x(l.output_throughput), self.y(v))
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        writeln!(
            svg,
            r#"<polyline class="p99" points="{}" fill="none" stroke="{colour}" stroke-width="1.5" stroke-dasharray="5,4"/>"#,
            points(|s| s.p99)
        )
        .expect("writing to a String");
        writeln!(
            svg,
            r#"<polyline class="p50" points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            points(|s| s.p50)
        )
        .expect("writing to a String");
        for l in levels {
            let (x, y) = (self.x(l.output_throughput), self.y((panel.latency)(l).p50));
            writeln!(
                svg,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{colour}"><title>{}: concurrency {}, {:.1} tok/s, p50 {:.1} ms</title></circle>"#,
                escape(&s.label),
                l.concurrency,
                l.output_throughput,
                (panel.latency)(l).p50
            )
            .expect("writing to a String");
            text(
                svg,
                x + 5.0,
                y - 6.0,
                "start",
                10.0,
                &l.concurrency.to_string(),
            );
        }
    }
}

fn legend(svg: &mut String, series: &[Series]) {
    let y = HEIGHT - 22.0;
    let mut x = LEFTS[0];
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="3"/>"#,
            y - 4.0,
            x + 24.0,
            y - 4.0
        )
        .expect("writing to a String");
        text(svg, x + 30.0, y, "start", 12.0, &s.label);
        x += 40.0 + 7.0 * s.label.chars().count() as f64;
    }
    text(
        svg,
        WIDTH - 20.0,
        y,
        "end",
        11.0,
        "solid: p50 (labels: concurrency), dashed: p99",
    );
}

fn line(svg: &mut String, (x1, y1): (f64, f64), (x2, y2): (f64, f64), colour: &str) {
    writeln!(
        svg,
        r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{colour}"/>"#
    )
    .expect("writing to a String");
}

fn text(svg: &mut String, x: f64, y: f64, anchor: &str, size: f64, content: &str) {
    writeln!(
        svg,
        r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" font-size="{size}">{}</text>"#,
        escape(content)
    )
    .expect("writing to a String");
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A round upper bound (1, 2 or 5 × 10^k) at or above `max`; 1 for nothing to show.
fn nice_max(max: f64) -> f64 {
    if !(max.is_finite() && max > 0.0) {
        return 1.0;
    }
    let step = nice_step(max / 5.0);
    (max / step).ceil().max(1.0) * step
}

fn nice_step(raw: f64) -> f64 {
    let magnitude = 10f64.powf(raw.log10().floor());
    let unit = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .find(|m| m * magnitude >= raw)
        .unwrap_or(10.0);
    unit * magnitude
}

/// Tick values from 0 to `max` (a [`nice_max`]) inclusive.
fn ticks(max: f64) -> Vec<f64> {
    let step = nice_step(max / 5.0);
    let n = (max / step).round() as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

fn format_tick(v: f64) -> String {
    if v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::LevelReport;

    fn level(concurrency: usize, throughput: f64, tpot: f64) -> LevelReport {
        let summary = |v: f64| LatencySummary {
            count: 1,
            mean: v,
            p50: v,
            p90: v,
            p99: v * 1.5,
            max: v * 2.0,
        };
        LevelReport {
            concurrency,
            completed: 4,
            output_throughput: throughput,
            tpot_ms: summary(tpot),
            ttft_ms: summary(tpot * 4.0),
            ..LevelReport::default()
        }
    }

    #[test]
    fn nice_bounds_are_round_and_cover_the_data() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(87.0), 100.0);
        assert_eq!(nice_max(101.0), 150.0);
        assert_eq!(nice_max(3.2), 4.0);
        assert_eq!(ticks(100.0), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
    }

    #[test]
    fn every_series_gets_lines_points_and_a_legend_entry() {
        let a = BenchResult {
            levels: vec![level(1, 10.0, 20.0), level(4, 30.0, 40.0)],
            ..BenchResult::default()
        };
        let b = BenchResult {
            levels: vec![level(1, 12.0, 15.0)],
            ..BenchResult::default()
        };
        let svg = latency_throughput_svg(&[
            Series {
                label: "moeserve <cpu>".into(),
                result: &a,
            },
            Series {
                label: "other".into(),
                result: &b,
            },
        ]);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        // Two panels × two series × (p50 + p99).
        assert_eq!(svg.matches("<polyline").count(), 8);
        // Two panels × three points.
        assert_eq!(svg.matches("<circle").count(), 6);
        assert!(svg.contains("moeserve &lt;cpu&gt;"));
        assert!(!svg.contains("<cpu>"));
    }
}
