//! The timeline plot (`<out>/timeline.svg`), made with plotters' SVG
//! backend: fault windows per kind, the convergence lag (sections declared
//! but not applied, summed over the fleet), and CPU per component.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use crate::checker::fault_windows;
use crate::history::{Entry, Event};
use crate::schedule::FAULT_KINDS;

pub fn timeline(path: &Path, entries: &[Entry], end_ms: u64) -> anyhow::Result<()> {
    let end = end_ms as f64 / 1000.0;
    let root = SVGBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let panels = root.split_evenly((3, 1));
    let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("plotting: {e:?}");

    // Faults.
    let mut chart = ChartBuilder::on(&panels[0])
        .caption("faults (start → heal)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(25)
        .y_label_area_size(130)
        .build_cartesian_2d(0.0..end, 0.0..FAULT_KINDS.len() as f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .y_labels(FAULT_KINDS.len())
        .y_label_formatter(&|y| {
            FAULT_KINDS
                .get(*y as usize)
                .map(|k| k.to_string())
                .unwrap_or_default()
        })
        .draw()
        .map_err(err)?;
    for (kind, _, from, to) in fault_windows(entries, end_ms) {
        let row = FAULT_KINDS.iter().position(|k| *k == kind).unwrap_or(0) as f64;
        let color = Palette99::pick(row as usize).mix(0.8);
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [
                    (from as f64 / 1000.0, row + 0.15),
                    (to as f64 / 1000.0, row + 0.85),
                ],
                color.filled(),
            )))
            .map_err(err)?;
    }

    // Convergence lag.
    let behind: Vec<(f64, f64)> = entries
        .iter()
        .filter_map(|e| match &e.event {
            Event::Resources {
                behind: Some(b), ..
            } => Some((e.t_ms as f64 / 1000.0, *b as f64)),
            _ => None,
        })
        .collect();
    let max_b = behind.iter().map(|p| p.1).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&panels[1])
        .caption(
            "convergence lag: sections declared but not applied (fleet)",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(25)
        .y_label_area_size(130)
        .build_cartesian_2d(0.0..end, 0.0..max_b * 1.1)
        .map_err(err)?;
    chart.configure_mesh().draw().map_err(err)?;
    chart
        .draw_series(LineSeries::new(behind, &BLUE))
        .map_err(err)?;

    // CPU per component, percent of one core, between samples.
    let mut last: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for e in entries {
        if let Event::Resources { cpu, .. } = &e.event {
            let t = e.t_ms as f64 / 1000.0;
            for (name, secs) in cpu {
                if let Some((t0, s0)) = last.get(name)
                    && t > *t0
                {
                    let pct = ((secs - s0) / (t - t0) * 100.0).max(0.0);
                    series.entry(name.clone()).or_default().push((t, pct));
                }
                last.insert(name.clone(), (t, *secs));
            }
        }
    }
    let max_cpu = series.values().flatten().map(|p| p.1).fold(10.0, f64::max);
    let mut chart = ChartBuilder::on(&panels[2])
        .caption("CPU, % of one core", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(25)
        .y_label_area_size(130)
        .build_cartesian_2d(0.0..end, 0.0..max_cpu * 1.1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .draw()
        .map_err(err)?;
    for (i, (name, pts)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}
