//! `replay --plot`: a PNG of MoonBright's allocated and reserved bytes over the trace's events,
//! and the reserved bytes the trace recorded when it has segment events.
//!
//! Text is drawn with the Hack font (MIT / Bitstream Vera licence) that the
//! `epaint_default_fonts` crate ships, through plotters' `ab_glyph` renderer: no system font
//! and no font file in this repository.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::replay::Outcome;
use crate::GIB;

const FONT: &str = "sans-serif";

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is a constant inside a crate; it parses, or no text could ever be drawn.
        let _ = register_font(FONT, FontStyle::Normal, epaint_default_fonts::HACK_REGULAR);
    });
}

pub(crate) fn draw(o: &Outcome, path: &Path) -> Result<(), String> {
    register();
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let series = &o.report.series;
    if series.is_empty() {
        return Err(err(&"the trace has no events"));
    }
    let g = |b: u64| b as f64 / GIB as f64;
    let x_max = series.last().map(|p| p.event + 1).unwrap_or(1) as f64;
    let y_max = series
        .iter()
        .map(|p| p.reserved.max(p.allocated))
        .chain(o.recorded_series.iter().copied())
        .max()
        .unwrap_or(0);
    let y_max = (g(y_max) * 1.08).max(1e-3);

    let root = BitMapBackend::new(path, (1400, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "{}: MoonBright peak reserved / peak allocated {:.3}{} ({} backend)",
        o.name(),
        o.ratio(),
        o.recorded
            .reserved_over_requested()
            .map(|r| format!(", recorded {r:.3}"))
            .unwrap_or_default(),
        o.backend
    );
    let mut chart = ChartBuilder::on(&root)
        .margin(15)
        .caption(title, (FONT, 22))
        .set_label_area_size(LabelAreaPosition::Left, 70)
        .set_label_area_size(LabelAreaPosition::Bottom, 50)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("event")
        .y_desc("GiB")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style((FONT, 14))
        .draw()
        .map_err(|e| err(&e))?;

    let xs: Vec<f64> = series.iter().map(|p| p.event as f64).collect();
    if !o.recorded_series.is_empty() {
        let green = RGBColor(60, 160, 60);
        chart
            .draw_series(LineSeries::new(
                xs.iter().zip(&o.recorded_series).map(|(x, y)| (*x, g(*y))),
                green.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label("reserved, as recorded in the trace")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], green.stroke_width(2))
            });
    }
    chart
        .draw_series(LineSeries::new(
            series.iter().map(|p| (p.event as f64, g(p.reserved))),
            RED.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("MoonBright reserved")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(
            series.iter().map(|p| (p.event as f64, g(p.allocated))),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("allocated (live requested bytes)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
