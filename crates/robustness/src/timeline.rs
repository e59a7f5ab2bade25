//! A failing run's history as an HTML page: one SVG row per client, an operation a bar from
//! invocation to return (unknown outcomes dashed to the end of their server process), faults as
//! shaded bands, the operations a violation names in red, and the violations listed underneath.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use crate::checks::Findings;
use crate::history::{History, Op, Outcome};

const WIDTH: f64 = 1600.0;
const ROW: f64 = 22.0;
const LEFT: f64 = 90.0;
/// More than this many operations make an unreadable picture: only the keys in violations are drawn.
const MAX_DRAWN: usize = 4000;

pub fn render(seed: u64, history: &History, findings: &Findings) -> String {
    let flagged: BTreeSet<usize> = findings
        .violations
        .iter()
        .flat_map(|v| v.ops.iter().copied())
        .collect();
    let bad_keys: BTreeSet<&str> = findings
        .violations
        .iter()
        .map(|v| v.key.as_str())
        .filter(|k| !k.is_empty())
        .collect();
    let drawn: Vec<&Op> = if history.ops.len() > MAX_DRAWN && !bad_keys.is_empty() {
        history
            .ops
            .iter()
            .filter(|op| bad_keys.contains(op.key.as_str()))
            .collect()
    } else {
        history.ops.iter().collect()
    };
    let start = history
        .incarnations
        .first()
        .map_or(0, |i| i.started_us)
        .min(
            drawn
                .iter()
                .map(|op| op.invoked_us)
                .min()
                .unwrap_or(u64::MAX),
        );
    let end = drawn
        .iter()
        .filter_map(|op| op.returned_us)
        .chain(history.faults.iter().map(|f| f.ended_us))
        .max()
        .unwrap_or(start + 1)
        .max(start + 1);
    let mut svg = draw(history, &drawn, &flagged, start, end);
    // The first violation up close: its operations on its key, ±0.5 s.
    if let Some(first) = findings.violations.iter().find(|v| !v.ops.is_empty()) {
        let named: Vec<&Op> = history
            .ops
            .iter()
            .filter(|op| first.ops.contains(&op.id))
            .collect();
        let from = named.iter().map(|op| op.invoked_us).min().unwrap_or(start);
        let to = named
            .iter()
            .map(|op| op.returned_us.unwrap_or(op.invoked_us))
            .max()
            .unwrap_or(end);
        let (from, to) = (from.saturating_sub(500_000), to.saturating_add(500_000));
        let near: Vec<&Op> = history
            .ops
            .iter()
            .filter(|op| op.key == first.key)
            .filter(|op| op.invoked_us <= to && op.returned_us.unwrap_or(u64::MAX) >= from)
            .collect();
        svg.push_str(&format!(
            "<h2>Up close: {} on {}</h2>",
            esc(first.check),
            esc(&first.key)
        ));
        svg.push_str(&draw(history, &near, &flagged, from, to.max(from + 1)));
    }

    let mut html = format!(
        "<!doctype html><meta charset=utf-8><title>mqstate robustness run {seed}</title>\
         <h1>Run seed {seed}: {} violation(s)</h1>\
         <p>Rows are clients; bars run from invocation to reply (dashed gray: no reply, drawn to the end of \
         the server process it was sent to). Orange bands are faults, dashed lines the end of a server \
         process. Red: operations a violation names. Hover for details.</p>",
        findings.violations.len()
    );
    html.push_str(&svg);
    html.push_str("<h2>Violations</h2><ul>");
    for v in &findings.violations {
        let _ = write!(
            html,
            "<li><b>{}</b> {}: {}</li>",
            esc(v.check),
            esc(&v.key),
            esc(&v.detail)
        );
    }
    html.push_str("</ul><h2>Operations on the keys in violations</h2><table border=1 cellspacing=0><tr><th>#</th><th>client</th><th>key</th><th>command</th><th>invoked µs</th><th>returned µs</th><th>outcome</th><th>process</th></tr>");
    for op in history
        .ops
        .iter()
        .filter(|op| bad_keys.contains(op.key.as_str()))
    {
        let style = if flagged.contains(&op.id) {
            " style=\"color:red\""
        } else {
            ""
        };
        let _ = write!(
            html,
            "<tr{style}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            op.id,
            esc(&op.client),
            esc(&op.key),
            esc(&format!("{:?}", op.cmd)),
            op.invoked_us - start.min(op.invoked_us),
            op.returned_us.map_or("—".into(), |r| (r - start.min(r)).to_string()),
            esc(&format!("{:?}", op.outcome)),
            op.incarnation
        );
    }
    html.push_str("</table>");
    html
}

fn esc(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn draw(
    history: &History,
    drawn: &[&Op],
    flagged: &BTreeSet<usize>,
    start: u64,
    end: u64,
) -> String {
    let x = |t: u64| {
        LEFT + (t.clamp(start, end) - start) as f64 / (end - start) as f64 * (WIDTH - LEFT - 10.0)
    };
    let mut rows: BTreeMap<&str, usize> = BTreeMap::new();
    for op in drawn {
        let next = rows.len();
        rows.entry(op.client.as_str()).or_insert(next);
    }
    let height = (rows.len() as f64 + 2.0) * ROW + 20.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="monospace" font-size="11">"#
    );
    for fault in history
        .faults
        .iter()
        .filter(|f| f.ended_us >= start && f.started_us <= end)
    {
        let (a, b) = (
            x(fault.started_us),
            x(fault.ended_us).max(x(fault.started_us) + 2.0),
        );
        let _ = write!(
            svg,
            r#"<rect x="{a:.1}" y="0" width="{:.1}" height="{height}" fill="orange" opacity="0.25"><title>{}: {}</title></rect><text x="{a:.1}" y="12">{}</text>"#,
            b - a,
            esc(&fault.kind),
            esc(&fault.detail),
            esc(&fault.kind)
        );
    }
    for incarnation in &history.incarnations {
        if let Some(ended) = incarnation.ended_us {
            let at = x(ended);
            let _ = write!(
                svg,
                r#"<line x1="{at:.1}" x2="{at:.1}" y1="0" y2="{height}" stroke="black" stroke-dasharray="4 2"/>"#
            );
        }
    }
    for (client, row) in &rows {
        let y = 20.0 + *row as f64 * ROW;
        let _ = write!(
            svg,
            r#"<text x="4" y="{:.1}">{}</text>"#,
            y + 12.0,
            esc(client)
        );
    }
    for op in drawn {
        let y = 20.0 + rows[op.client.as_str()] as f64 * ROW;
        let (a, known_end) = (x(op.invoked_us), op.returned_us);
        let b = x(known_end.unwrap_or_else(|| history.effect_deadline_us(op.incarnation).min(end)));
        let color = if flagged.contains(&op.id) {
            "red"
        } else {
            match op.outcome {
                Outcome::Written(_) | Outcome::Deleted(1) => "steelblue",
                Outcome::Hit { .. } | Outcome::Miss => "seagreen",
                Outcome::Unknown | Outcome::Unexpected(_) => "gray",
                _ => "silver",
            }
        };
        let dash = if known_end.is_none() {
            r#" stroke-dasharray="3 2""#
        } else {
            ""
        };
        let _ = write!(
            svg,
            r#"<rect x="{a:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{color}" stroke="{color}"{dash} fill-opacity="0.7"><title>#{} {} {} {} → {:?}</title></rect>"#,
            (b - a).max(1.0),
            ROW - 6.0,
            op.id,
            esc(&op.client),
            esc(op.cmd.name()),
            esc(&op.key),
            op.outcome
        );
    }
    svg.push_str("</svg>");
    svg
}
