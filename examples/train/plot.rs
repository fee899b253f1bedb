//! `loss_curves.png` with plotters: two panels sharing the step axis. Top: every run's training loss
//! (a 10-step moving average, on a log axis of the gap to the entropy floor, so the runs separate
//! where they approach it). Bottom: each mixed run's loss minus fp32's at the same step (same moving
//! average), so runs that overlap on the top panel are told apart. Text is drawn with DejaVu Sans,
//! embedded in the binary (the `dejavu` crate through plotters' `ab_glyph` feature): no system fonts.

use std::io::BufWriter;
use std::path::Path;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::Error;

const WIDTH: u32 = 1000;
const HEIGHT: u32 = 760;
const SMOOTH: usize = 10;
const WIDTHS: [u32; 4] = [6, 3, 1, 1];
const COLOURS: [RGBColor; 4] =
    [RGBColor(0, 0, 0), RGBColor(31, 119, 180), RGBColor(214, 39, 40), RGBColor(44, 160, 44)];

/// Draws the curves (`(name, [(step, loss)])`, fp32 first if present) and the floor into `path`.
pub fn loss_curves(path: &Path, runs: &[(&str, &[(usize, f32)])], floor: f64) -> Result<(), Error> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the embedded DejaVu Sans font did not load")?;
    let mut pixels = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(HEIGHT * 3 / 5);
        let smoothed: Vec<(&str, Vec<(f64, f64)>)> =
            runs.iter().map(|(n, c)| (*n, moving_average(c))).collect();
        gap_panel(&top, &smoothed, floor)?;
        difference_panel(&bottom, &smoothed)?;
        root.present()?;
    }
    write_png(path, &pixels)
}

/// Mean of the last `SMOOTH` losses at each step.
fn moving_average(curve: &[(usize, f32)]) -> Vec<(f64, f64)> {
    (0..curve.len())
        .map(|i| {
            let window = &curve[i.saturating_sub(SMOOTH - 1)..=i];
            let mean = window.iter().map(|(_, l)| f64::from(*l)).sum::<f64>() / window.len() as f64;
            (curve[i].0 as f64, mean)
        })
        .collect()
}

fn gap_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    runs: &[(&str, Vec<(f64, f64)>)],
    floor: f64,
) -> Result<(), Error> {
    let steps = runs.iter().map(|(_, c)| c.len()).max().unwrap_or(1) as f64;
    let gaps: Vec<f64> =
        runs.iter().flat_map(|(_, c)| c.iter().map(|(_, l)| l - floor)).filter(|g| *g > 0.0).collect();
    let high = gaps.iter().copied().fold(1e-3, f64::max) * 1.5;
    let low = gaps.iter().copied().fold(high, f64::min).max(1e-4) / 1.5;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("training loss above the entropy floor ({floor:.4} nats/token), {SMOOTH}-step mean"),
            ("sans-serif", 22),
        )
        .margin(12)
        .margin_right(30)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..steps, (low..high).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|step| format!("{step:.0}"))
        .y_desc("loss - floor (nats/token, log)")
        .axis_desc_style(("sans-serif", 18))
        .label_style(("sans-serif", 15))
        .draw()?;
    for (index, (name, curve)) in runs.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let points = curve.iter().filter(|(_, l)| *l > floor).map(|(s, l)| (*s, l - floor));
        // Wider lines first: runs that coincide still show as a thick line with thinner ones on it.
        let width = WIDTHS[index % WIDTHS.len()];
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(width)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(width)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 17))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

fn difference_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    runs: &[(&str, Vec<(f64, f64)>)],
) -> Result<(), Error> {
    let Some((reference_name, reference)) = runs.iter().find(|(n, _)| n.starts_with("fp32")) else {
        return Ok(());
    };
    let steps = reference.len() as f64;
    let differences: Vec<(usize, Vec<(f64, f64)>)> = runs
        .iter()
        .enumerate()
        .filter(|(_, (n, _))| n != reference_name)
        .map(|(i, (_, c))| (i, c.iter().zip(reference).map(|((s, l), (_, r))| (*s, l - r)).collect()))
        .collect();
    let extent =
        differences.iter().flat_map(|(_, d)| d.iter().map(|(_, v)| v.abs())).fold(1e-3, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("each run minus {reference_name} at the same step ({SMOOTH}-step mean)"),
            ("sans-serif", 22),
        )
        .margin(12)
        .margin_right(30)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..steps, -extent..extent)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|step| format!("{step:.0}"))
        .y_desc("loss difference (nats/token)")
        .axis_desc_style(("sans-serif", 18))
        .label_style(("sans-serif", 15))
        .draw()?;
    chart.draw_series(LineSeries::new([(0.0, 0.0), (steps, 0.0)], COLOURS[0].stroke_width(1)))?;
    for (index, difference) in differences {
        let colour = COLOURS[index % COLOURS.len()];
        chart.draw_series(LineSeries::new(difference, colour.stroke_width(2)))?;
    }
    Ok(())
}

fn write_png(path: &Path, pixels: &[u8]) -> Result<(), Error> {
    let file = std::fs::File::create(path)?;
    let mut encoder = png::Encoder::new(BufWriter::new(file), WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header()?.write_image_data(pixels)?;
    Ok(())
}
