//! Plain SVG plots of what a run measured (people read plots faster than
//! tables): empirical CDFs of latency samples with a reference line (the
//! TTL, 2/3·TTL), and a line of one quantity against another (RSS vs.
//! tasks). Hand-written SVG: no plotting stack to install.

use std::fmt::Write as _;
use std::time::Duration;

const W: f64 = 640.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 40.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
];

/// A "nice" upper bound for an axis ending at `max`.
fn nice(max: f64) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let mag = 10f64.powf(max.log10().floor());
    [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|v| *v >= max)
        .unwrap_or(10.0 * mag)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Axes from 0 to `xmax` and 0 to `ymax` with five ticks each.
fn frame(out: &mut String, title: &str, xlabel: &str, ylabel: &str, xmax: f64, ymax: f64) {
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>
<line x1="{LEFT}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>
"#,
        W / 2.0,
        escape(title),
        H - BOTTOM,
        W - RIGHT,
        H - BOTTOM,
        H - BOTTOM,
        LEFT + (W - LEFT - RIGHT) / 2.0,
        H - 12.0,
        escape(xlabel),
        TOP + (H - TOP - BOTTOM) / 2.0,
        TOP + (H - TOP - BOTTOM) / 2.0,
        escape(ylabel),
    );
    for i in 0..=5 {
        let f = f64::from(i) / 5.0;
        let (x, y) = (sx(f * xmax, xmax), sy(f * ymax, ymax));
        let _ = writeln!(
            out,
            r#"<line x1="{x}" y1="{}" x2="{x}" y2="{}" stroke="black"/><text x="{x}" y="{}" text-anchor="middle">{}</text>
<line x1="{}" y1="{y}" x2="{LEFT}" y2="{y}" stroke="black"/><text x="{}" y="{}" text-anchor="end">{}</text>"#,
            H - BOTTOM,
            H - BOTTOM + 5.0,
            H - BOTTOM + 18.0,
            label(f * xmax),
            LEFT - 5.0,
            LEFT - 8.0,
            y + 4.0,
            label(f * ymax),
        );
    }
}

fn label(v: f64) -> String {
    if v >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn sx(v: f64, max: f64) -> f64 {
    LEFT + v / max * (W - LEFT - RIGHT)
}

fn sy(v: f64, max: f64) -> f64 {
    H - BOTTOM - v / max * (H - TOP - BOTTOM)
}

/// Legend entry `i` of `n`, stacked in the bottom-right corner (empty in
/// a CDF and in a rising line), on a white box.
fn legend(out: &mut String, i: usize, n: usize, text: &str) {
    let width = 250.0;
    let x = W - RIGHT - width;
    let top = H - BOTTOM - 12.0 - 16.0 * n as f64;
    if i == 0 {
        let _ = writeln!(
            out,
            r##"<rect x="{}" y="{}" width="{width}" height="{}" fill="white" stroke="#ccc"/>"##,
            x - 6.0,
            top - 4.0,
            16.0 * n as f64 + 8.0
        );
    }
    let y = top + 8.0 + 16.0 * i as f64;
    let _ = writeln!(
        out,
        r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
        x + 20.0,
        COLOURS[i % COLOURS.len()],
        x + 26.0,
        y + 4.0,
        escape(text)
    );
}

/// The empirical CDF of each series (sorted samples), in milliseconds,
/// with a dashed vertical line at `reference`.
pub fn cdf(
    title: &str,
    series: &[(String, &[Duration])],
    reference: Option<(&str, Duration)>,
) -> String {
    let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().map(ms))
        .chain(reference.iter().map(|(_, d)| ms(d)))
        .fold(0.0, f64::max);
    let xmax = nice(max * 1.05);
    let mut out = String::new();
    frame(
        &mut out,
        title,
        "milliseconds",
        "fraction of samples ≤ x",
        xmax,
        1.0,
    );
    for (i, (name, v)) in series.iter().enumerate() {
        let n = v.len().max(1) as f64;
        let mut path = format!("M{} {}", sx(0.0, xmax), sy(0.0, 1.0));
        for (k, d) in v.iter().enumerate() {
            let x = sx(ms(d), xmax);
            let _ = write!(
                path,
                " L{x:.1} {:.1} L{x:.1} {:.1}",
                sy(k as f64 / n, 1.0),
                sy((k + 1) as f64 / n, 1.0)
            );
        }
        let _ = writeln!(
            out,
            r#"<path d="{path}" fill="none" stroke="{}" stroke-width="2"/>"#,
            COLOURS[i % COLOURS.len()]
        );
        legend(
            &mut out,
            i,
            series.len(),
            &format!("{name} (n = {})", v.len()),
        );
    }
    if let Some((name, d)) = reference {
        let x = sx(ms(&d), xmax);
        let _ = writeln!(
            out,
            r#"<line x1="{x}" y1="{TOP}" x2="{x}" y2="{}" stroke="gray" stroke-dasharray="6 4"/><text x="{}" y="{}" fill="gray" text-anchor="end">{}</text>"#,
            H - BOTTOM,
            x - 4.0,
            H - BOTTOM - 8.0,
            escape(name)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// Each series' `points` (x, y) joined by a line, each marked, with a
/// legend naming the series when there is more than one.
pub fn lines(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let all = || series.iter().flat_map(|(_, p)| p.iter());
    let xmax = nice(all().map(|p| p.0).fold(0.0, f64::max));
    let ymax = nice(all().map(|p| p.1).fold(0.0, f64::max) * 1.1);
    let mut out = String::new();
    frame(&mut out, title, xlabel, ylabel, xmax, ymax);
    for (i, (name, points)) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let path: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x, xmax), sy(*y, ymax)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            path.join(" "),
        );
        for (x, y) in points {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{colour}"/>"#,
                sx(*x, xmax),
                sy(*y, ymax),
            );
        }
        if series.len() > 1 {
            legend(&mut out, i, series.len(), name);
        }
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_end_on_round_numbers() {
        assert_eq!(nice(0.0), 1.0);
        assert_eq!(nice(7.3), 8.0);
        assert_eq!(nice(180.0), 200.0);
        assert_eq!(nice(4100.0), 5000.0);
        assert_eq!(nice(53.6), 60.0);
    }

    #[test]
    fn a_cdf_has_one_step_per_sample_and_the_reference() {
        let v = [Duration::from_millis(10), Duration::from_millis(30)];
        let svg = cdf(
            "t",
            &[("a".into(), &v[..])],
            Some(("TTL", Duration::from_millis(40))),
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches(" L").count(), 4, "{svg}");
        assert!(svg.contains("TTL") && svg.contains("a (n = 2)"));
    }

    #[test]
    fn lines_draw_each_series_and_name_them() {
        let svg = lines(
            "t",
            "x",
            "y",
            &[
                ("per lease".into(), vec![(10.0, 1.0), (100.0, 2.0)]),
                ("per worker".into(), vec![(10.0, 0.1), (100.0, 0.2)]),
            ],
        );
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 4);
        assert!(svg.contains("per lease") && svg.contains("per worker"));
    }
}
