//! What the plots share: the font, a line's mark in the legend, and the legend itself.

/// The font for the plot's text, from the system (DejaVu Sans on Debian).
fn font() -> Option<&'static [u8]> {
    let candidates = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    ];
    candidates
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .map(|bytes| &*Box::leak(bytes.into_boxed_slice()))
}

/// A chart of ours: `X` across, a linear scale up.
type Chart<'a, X> = plotters::chart::ChartContext<
    'a,
    plotters::backend::BitMapBackend<'a>,
    plotters::coord::cartesian::Cartesian2d<X, plotters::coord::types::RangedCoordf64>,
>;

/// A line's mark in the legend, in its colour.
pub fn mark(
    color: plotters::style::RGBColor,
) -> impl Fn((i32, i32)) -> plotters::element::PathElement<(i32, i32)> {
    use plotters::style::Color;
    move |(x, y)| {
        plotters::element::PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(3))
    }
}

/// The legend of every labelled line of `chart`, at `position`.
pub fn legend<'a, X: plotters::coord::ranged1d::Ranged>(
    chart: &mut Chart<'a, X>,
    position: plotters::chart::SeriesLabelPosition,
) -> anyhow::Result<()> {
    use plotters::style::{BLACK, Color, WHITE};
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .position(position)
        .draw()?;
    Ok(())
}

/// Whether the plots can have text: the system's font, registered for plotters.
pub fn text() -> bool {
    font().is_some_and(|f| {
        plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, f).is_ok()
    })
}
