//! The loss curves of every run on one PNG plot, drawn by hand: a white canvas, axes with numbered ticks,
//! one coloured polyline per run, the entropy floor as a dashed grey line, and a legend. Text uses a
//! built-in 5x7 pixel font (digits and the few letters run names need), so no font files are required.

use std::io::BufWriter;
use std::path::Path;

const WIDTH: usize = 900;
const HEIGHT: usize = 540;
const LEFT: usize = 80;
const RIGHT: usize = 20;
const TOP: usize = 20;
const BOTTOM: usize = 50;
const COLOURS: [[u8; 3]; 4] = [[0, 0, 0], [31, 119, 180], [214, 39, 40], [44, 160, 44]];
const GREY: [u8; 3] = [150, 150, 150];

/// 5x7 glyphs, one byte per row, the low five bits left to right.
fn glyph(c: char) -> [u8; 7] {
    match c {
        '0' => [14, 17, 19, 21, 25, 17, 14],
        '1' => [4, 12, 4, 4, 4, 4, 14],
        '2' => [14, 17, 1, 2, 4, 8, 31],
        '3' => [30, 1, 1, 14, 1, 1, 30],
        '4' => [2, 6, 10, 18, 31, 2, 2],
        '5' => [31, 16, 30, 1, 1, 17, 14],
        '6' => [6, 8, 16, 30, 17, 17, 14],
        '7' => [31, 1, 2, 4, 8, 8, 8],
        '8' => [14, 17, 17, 14, 17, 17, 14],
        '9' => [14, 17, 17, 15, 1, 2, 12],
        '.' => [0, 0, 0, 0, 0, 12, 12],
        'f' => [6, 9, 8, 28, 8, 8, 8],
        'p' => [0, 0, 30, 17, 30, 16, 16],
        'b' => [16, 16, 22, 25, 17, 17, 30],
        'l' => [12, 4, 4, 4, 4, 4, 14],
        'o' => [0, 0, 14, 17, 17, 17, 14],
        'r' => [0, 0, 22, 25, 16, 16, 16],
        'O' => [14, 17, 17, 17, 17, 17, 14],
        _ => [0; 7],
    }
}

struct Canvas {
    pixels: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Canvas { pixels: vec![255; WIDTH * HEIGHT * 3] }
    }

    fn set(&mut self, x: i64, y: i64, colour: [u8; 3]) {
        if (0..WIDTH as i64).contains(&x) && (0..HEIGHT as i64).contains(&y) {
            let i = (y as usize * WIDTH + x as usize) * 3;
            self.pixels[i..i + 3].copy_from_slice(&colour);
        }
    }

    /// A line two pixels thick; `dash` > 0 leaves gaps of that many pixels.
    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), colour: [u8; 3], dash: usize) {
        let steps = (x1 - x0).abs().max((y1 - y0).abs()).ceil().max(1.0) as usize;
        for i in 0..=steps {
            if dash > 0 && (i / dash) % 2 == 1 {
                continue;
            }
            let t = i as f64 / steps as f64;
            let (x, y) = ((x0 + t * (x1 - x0)).round() as i64, (y0 + t * (y1 - y0)).round() as i64);
            for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                self.set(x + dx, y + dy, colour);
            }
        }
    }

    /// Text at scale 2, its top-left corner at (x, y).
    fn text(&mut self, x: usize, y: usize, text: &str, colour: [u8; 3]) {
        for (k, c) in text.chars().enumerate() {
            for (row, bits) in glyph(c).iter().enumerate() {
                for col in 0..5 {
                    if bits & (16 >> col) != 0 {
                        for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                            let px = (x + k * 12 + col * 2 + dx) as i64;
                            self.set(px, (y + row * 2 + dy) as i64, colour);
                        }
                    }
                }
            }
        }
    }
}

/// Writes `curves` (name, points (step, loss)) and the horizontal `floor` to a PNG at `path`.
pub fn loss_curves(path: &Path, curves: &[(&str, &[(usize, f32)])], floor: f64) -> std::io::Result<()> {
    let steps = curves.iter().flat_map(|(_, c)| c.last().map(|p| p.0)).max().unwrap_or(1).max(2);
    let losses = curves.iter().flat_map(|(_, c)| c.iter().map(|p| f64::from(p.1)));
    let (low, high) = losses.fold((floor, floor), |(lo, hi), l| (lo.min(l), hi.max(l)));
    let (low, high) = (low - 0.05 * (high - low), high + 0.02 * (high - low));
    let (plot_w, plot_h) = ((WIDTH - LEFT - RIGHT) as f64, (HEIGHT - TOP - BOTTOM) as f64);
    let to_px = |step: usize, loss: f64| {
        let x = LEFT as f64 + plot_w * (step - 1) as f64 / (steps - 1) as f64;
        (x, TOP as f64 + plot_h * (high - loss) / (high - low))
    };
    let mut canvas = Canvas::new();
    let (x0, y0, x1, y1) = (LEFT as f64, TOP as f64, (WIDTH - RIGHT) as f64, (HEIGHT - BOTTOM) as f64);
    canvas.line((x0, y1), (x1, y1), [0; 3], 0);
    canvas.line((x0, y0), (x0, y1), [0; 3], 0);
    for i in 0..=4 {
        let loss = low + (high - low) * f64::from(i) / 4.0;
        let (_, y) = to_px(1, loss);
        canvas.line((x0 - 6.0, y), (x0, y), [0; 3], 0);
        canvas.text(8, y as usize - 7, &format!("{loss:.2}"), [0; 3]);
        let step = 1 + (steps - 1) * i as usize / 4;
        let (x, _) = to_px(step, low);
        canvas.line((x, y1), (x, y1 + 6.0), [0; 3], 0);
        canvas.text((x as usize).saturating_sub(12), HEIGHT - BOTTOM + 14, &step.to_string(), [0; 3]);
    }
    canvas.line(to_px(1, floor), to_px(steps, floor), GREY, 8);
    for (k, (name, curve)) in curves.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        for pair in curve.windows(2) {
            canvas.line(
                to_px(pair[0].0, f64::from(pair[0].1)),
                to_px(pair[1].0, f64::from(pair[1].1)),
                colour,
                0,
            );
        }
        let y = TOP + 10 + 24 * k;
        canvas.line(
            ((WIDTH - 260) as f64, (y + 6) as f64),
            ((WIDTH - 220) as f64, (y + 6) as f64),
            colour,
            0,
        );
        canvas.text(WIDTH - 210, y, name, colour);
    }
    let y = TOP + 10 + 24 * curves.len();
    canvas.line(((WIDTH - 260) as f64, (y + 6) as f64), ((WIDTH - 220) as f64, (y + 6) as f64), GREY, 8);
    canvas.text(WIDTH - 210, y, "floor", GREY);

    let file = std::fs::File::create(path)?;
    let mut encoder = png::Encoder::new(BufWriter::new(file), WIDTH as u32, HEIGHT as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(std::io::Error::other)?;
    writer.write_image_data(&canvas.pixels).map_err(std::io::Error::other)?;
    writer.finish().map_err(std::io::Error::other)
}
