//! `--plot FILE.svg`: throughput over time (top) and the latency distribution by percentile (bottom).

use std::path::Path;

use plotters::prelude::*;

use super::stats::Report;
use mqstate_cli::error::CliError;

/// Size of the drawing in pixels.
pub const PLOT_SIZE: (u32, u32) = (900, 700);

pub fn draw(path: &Path, report: &Report, percentiles: &[(f64, u64)]) -> Result<(), CliError> {
    render(path, report, percentiles).map_err(|e| CliError::Input {
        what: format!("--plot {} (drawing)", path.display()),
        source: std::io::Error::other(e),
    })
}

fn render(path: &Path, report: &Report, percentiles: &[(f64, u64)]) -> Result<(), String> {
    let root = SVGBackend::new(path, PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (top, bottom) = root.split_vertically(PLOT_SIZE.1 / 2);

    let seconds = report.ops_per_sec_timeline.len().max(1) as u32;
    let max_ops = report
        .ops_per_sec_timeline
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!("{}: throughput (ops/s)", report.mode),
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0u32..seconds, 0u64..max_ops + max_ops / 10 + 1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("ops/s")
        .draw()
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(LineSeries::new(
            report
                .ops_per_sec_timeline
                .iter()
                .enumerate()
                .map(|(i, &ops)| (i as u32 + 1, ops)),
            &BLUE,
        ))
        .map_err(|e| e.to_string())?;

    let max_us = percentiles
        .iter()
        .map(|&(_, us)| us)
        .max()
        .unwrap_or(0)
        .max(1);
    let mut chart = ChartBuilder::on(&bottom)
        .caption("latency by percentile (µs)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..100f64, 0u64..max_us + max_us / 10 + 1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("µs")
        .draw()
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(LineSeries::new(percentiles.iter().copied(), &RED))
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn writes_an_svg_with_both_charts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.svg");
        let report = Report {
            mode: "statestore".into(),
            ops: 10,
            elapsed_s: 2.0,
            ops_per_sec: 5.0,
            p50_us: 10,
            p90_us: 20,
            p99_us: 30,
            p999_us: 40,
            max_us: 50,
            mean_us: 15.0,
            replies: BTreeMap::new(),
            errors: BTreeMap::new(),
            ops_per_sec_timeline: vec![4, 6],
        };
        draw(&path, &report, &[(50.0, 10), (99.0, 30), (100.0, 50)]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        assert!(svg.contains("throughput") && svg.contains("latency by percentile"));
        assert!(svg.matches("<polyline").count() >= 2);
    }
}
