//! Charts of `specula bench` results (`--plot DIR`): SVG files drawn with `plotters`, one per
//! measurement the result holds.
//!
//! | file | from | shows |
//! |---|---|---|
//! | `throughput.svg` | CPU bench (`prefill_tok_s`, `decode_tok_s`); GPU receipt (`decode_batch1`, `floor_tok_s`) | tok/s as bars |
//! | `verify_cost.svg` | `verify_cost` (CPU bench with `--verify-rows`, GPU receipt) | an r-row forward's time over a one-row step, by r |
//! | `aggregate.svg` | engine bench (`levels`, one line per mode); GPU receipt (`aggregate_decode`) | aggregate decode tok/s by concurrent streams |
//! | `acceptance.svg` | engine bench (`levels` with drafts) | accepted / drafted tokens by streams, per mode |
//! | `prefill.svg` | GPU receipt (`prefill`) | prefill tok/s by prompt length |

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use serde_json::Value;

const SIZE: (u32, u32) = (720, 420);
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// A named series of (x, y) points.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

fn num(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// `(x, y)` of every item of `items` that has both fields as numbers.
fn points(items: &Value, x: &str, y: &str) -> Vec<(f64, f64)> {
    items
        .as_array()
        .map(|a| a.iter().filter_map(|i| Some((num(&i[x])?, num(&i[y])?))).collect())
        .unwrap_or_default()
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e}")
}

/// A line chart of `series` (x on a log2 scale when `log_x`), to `path`.
fn line_chart(path: &Path, title: &str, x_desc: &str, y_desc: &str, series: &[Series], log_x: bool) -> Result<()> {
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).collect();
    let (x0, x1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let y1 = all.iter().fold(0f64, |m, p| m.max(p.1)) * 1.1;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root);
    chart
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64);
    if log_x {
        let mut c = chart
            .build_cartesian_2d((x0.max(1.0)..x1.max(x0 + 1.0)).log_scale(), 0f64..y1.max(1e-9))
            .map_err(err)?;
        c.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(err)?;
        draw_lines(&mut c, series)?;
    } else {
        let mut c = chart
            .build_cartesian_2d(x0..x1.max(x0 + 1.0), 0f64..y1.max(1e-9))
            .map_err(err)?;
        c.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(err)?;
        draw_lines(&mut c, series)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Draw `series` as lines with points, and their legend, on `chart`.
fn draw_lines<'a, X>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
    series: &[Series],
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
{
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.points.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// A bar chart of `bars` (label, value), to `path`.
fn bar_chart(path: &Path, title: &str, y_desc: &str, bars: &[(String, f64)]) -> Result<()> {
    let y1 = bars.iter().fold(0f64, |m, b| m.max(b.1)) * 1.15;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let n = bars.len() as f64;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..n, 0f64..y1.max(1e-9))
        .map_err(err)?;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(bars.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-6 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    c.draw_series(bars.iter().enumerate().map(|(i, b)| {
        let x = i as f64;
        Rectangle::new([(x + 0.2, 0.0), (x + 0.8, b.1)], COLORS[i % COLORS.len()].filled())
    }))
    .map_err(err)?;
    c.draw_series(bars.iter().enumerate().map(|(i, b)| {
        Text::new(
            format!("{:.1}", b.1),
            (i as f64 + 0.35, b.1 * 1.02 + y1 * 0.02),
            ("sans-serif", 14),
        )
    }))
    .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Write the charts `result` (a `specula bench` JSON result: CPU, `--engine`, or a GPU
/// receipt) holds into `dir` (created if missing); returns the files written. Errors: the
/// directory cannot be made, or the result holds nothing to chart.
pub fn write_charts(result: &Value, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = result["model"]
        .as_str()
        .or_else(|| result["shape"]["name"].as_str())
        .unwrap_or("bench")
        .to_string();
    let mut written = Vec::new();
    let mut out = |file: &str| {
        let p = dir.join(file);
        written.push(p.clone());
        p
    };

    // Throughput bars.
    let mut bars = Vec::new();
    if let (Some(pp), Some(tg)) = (num(&result["prefill_tok_s"]), num(&result["decode_tok_s"])) {
        bars.push((format!("prefill {}", result["prompt_tokens"]), pp));
        bars.push((format!("decode {}", result["gen_tokens"]), tg));
    }
    if let Some(d) = num(&result["decode_batch1"]["tok_s"]) {
        bars.push(("decode, batch 1".to_string(), d));
        if let Some(f) = num(&result["floor_tok_s"]) {
            bars.push(("bandwidth floor".to_string(), f));
        }
    }
    if !bars.is_empty() {
        bar_chart(&out("throughput.svg"), &format!("{name}: tok/s"), "tokens / s", &bars)?;
    }

    // Verify cost.
    let verify = points(&result["verify_cost"], "rows", "relative_to_one_row");
    if !verify.is_empty() {
        line_chart(
            &out("verify_cost.svg"),
            &format!("{name}: verify cost"),
            "rows in one forward (k + 1)",
            "time / one-row step",
            &[Series {
                name: "r-row forward".into(),
                points: verify,
            }],
            false,
        )?;
    }

    // Aggregate decode by streams.
    let mut aggregate = Vec::new();
    let mut acceptance = Vec::new();
    if let Some(levels) = result["levels"].as_array() {
        let mut modes: Vec<String> = Vec::new();
        for l in levels {
            if let Some(m) = l["mode"].as_str() {
                if !modes.iter().any(|x| x == m) {
                    modes.push(m.to_string());
                }
            }
        }
        for m in modes {
            let of_mode: Vec<&Value> = levels.iter().filter(|l| l["mode"] == m.as_str()).collect();
            aggregate.push(Series {
                name: m.clone(),
                points: of_mode
                    .iter()
                    .filter_map(|l| Some((num(&l["streams"])?, num(&l["aggregate_decode_tok_s"])?)))
                    .collect(),
            });
            let acc: Vec<(f64, f64)> = of_mode
                .iter()
                .filter_map(|l| {
                    let drafted = num(&l["drafted"])?;
                    (drafted > 0.0).then(|| Some((num(&l["streams"])?, num(&l["accepted"])? / drafted)))?
                })
                .collect();
            if !acc.is_empty() {
                acceptance.push(Series { name: m, points: acc });
            }
        }
    }
    let gpu_aggregate = points(&result["aggregate_decode"], "streams", "tok_s_aggregate");
    if !gpu_aggregate.is_empty() {
        aggregate.push(Series {
            name: "specula".into(),
            points: gpu_aggregate,
        });
    }
    if !aggregate.is_empty() {
        line_chart(
            &out("aggregate.svg"),
            &format!("{name}: aggregate decode"),
            "concurrent streams",
            "tokens / s (all streams)",
            &aggregate,
            true,
        )?;
    }
    if !acceptance.is_empty() {
        line_chart(
            &out("acceptance.svg"),
            &format!("{name}: acceptance rate"),
            "concurrent streams",
            "accepted / drafted",
            &acceptance,
            true,
        )?;
    }

    // Prefill by prompt length (GPU receipts).
    let prefill = points(&result["prefill"], "tokens", "tok_s");
    if !prefill.is_empty() {
        line_chart(
            &out("prefill.svg"),
            &format!("{name}: prefill"),
            "prompt tokens",
            "tokens / s",
            &[Series {
                name: "prefill".into(),
                points: prefill,
            }],
            true,
        )?;
    }
    if written.is_empty() {
        anyhow::bail!("the bench result holds no measurement to chart");
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Each kind of result gives its charts, and each SVG shows the numbers' labels.
    #[test]
    fn charts_of_each_result_kind() {
        let dir = tempfile::tempdir().unwrap();
        let cpu = json!({"model": "m", "prompt_tokens": 512, "gen_tokens": 128, "prefill_tok_s": 812.5,
            "decode_tok_s": 97.25, "verify_cost": [{"rows": 1, "relative_to_one_row": 1.0},
            {"rows": 4, "relative_to_one_row": 1.4}]});
        let files = write_charts(&cpu, dir.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["throughput.svg", "verify_cost.svg"]);
        let svg = std::fs::read_to_string(&files[0]).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("812.5") && svg.contains("97.2"),
            "{svg}"
        );

        let engine = json!({"model": "m", "levels": [
            {"mode": "off", "streams": 1, "aggregate_decode_tok_s": 50.0, "drafted": 0, "accepted": 0},
            {"mode": "off", "streams": 8, "aggregate_decode_tok_s": 200.0, "drafted": 0, "accepted": 0},
            {"mode": "ngram", "streams": 1, "aggregate_decode_tok_s": 80.0, "drafted": 100, "accepted": 60},
            {"mode": "ngram", "streams": 8, "aggregate_decode_tok_s": 260.0, "drafted": 100, "accepted": 50}]});
        let d2 = dir.path().join("engine");
        let files = write_charts(&engine, &d2).unwrap();
        assert_eq!(files.len(), 2);
        let svg = std::fs::read_to_string(d2.join("aggregate.svg")).unwrap();
        assert!(svg.contains(">\nngram\n<") || svg.contains("ngram"), "{svg}");
        let acc = std::fs::read_to_string(d2.join("acceptance.svg")).unwrap();
        assert!(acc.contains("ngram") && !acc.contains(">\noff\n<"), "{acc}");

        assert!(write_charts(&json!({"model": "m"}), &dir.path().join("none")).is_err());
    }
}
