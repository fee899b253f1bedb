//! The main job's tables: each seed's runs side by side, and, over several seeds, each run's mean and
//! spread with its difference to fp32 paired by seed.

use crate::Run;

/// The runs of one seed.
#[derive(Debug)]
pub struct Seed {
    pub seed: u64,
    pub runs: Vec<Run>,
    /// The oracle's accuracy (always the likeliest successor) on this seed's held-out set.
    pub oracle: f64,
}

fn fp32_of(runs: &[Run]) -> Option<&Run> {
    runs.iter().find(|r| r.name.starts_with("fp32"))
}

/// One seed's table: speed, final loss and its gap to the floor, held-out accuracy, skips, bytes.
pub fn table(runs: &[Run], tokens: usize, floor: f64, best_accuracy: f64, oracle: f64) {
    let fp32_ms = fp32_of(runs).map(Run::median_ms);
    println!(
        "\n{:<9} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10}",
        "run", "step ms", "tokens/s", "loss", "gap", "accuracy", "skipped", "scale", "speed-up", "param B"
    );
    for run in runs {
        let ms = run.median_ms();
        println!(
            "{:<9} {ms:>8.2} {:>9.0} {:>8.4} {:>9.4} {:>8.1}% {:>8} {:>8} {:>8} {:>10}",
            run.name,
            tokens as f64 / (ms / 1e3),
            run.final_loss(),
            run.final_loss() - floor,
            100.0 * run.accuracy,
            run.skipped,
            run.scale,
            fp32_ms.map_or("-".to_string(), |f| format!("{:.2}x", f / ms)),
            run.bytes
        );
    }
    println!(
        "floor {floor:.4} nats/token; best accuracy {:.1}% (oracle on the held-out set: {:.1}%)",
        100.0 * best_accuracy,
        100.0 * oracle
    );
    println!("param B = parameters as stored (masters + half copies) + optimizer state.\n");
}

/// Mean and sample standard deviation.
fn mean_sd(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, var.sqrt())
}

/// `mean +- sd` scaled; `signed` for differences.
fn pm((mean, sd): (f64, f64), scale: f64, digits: usize, signed: bool) -> String {
    let mean =
        if signed { format!("{:+.digits$}", scale * mean) } else { format!("{:.digits$}", scale * mean) };
    format!("{mean} +- {:.digits$}", scale * sd)
}

/// The runs over every seed: the gap to the floor and the held-out accuracy as mean +- standard
/// deviation, each mixed run's difference to fp32 paired by seed, skips in total, speed-up (median).
pub fn across_seeds(seeds: &[Seed], floor: f64) {
    println!(
        "across {} seeds: mean +- standard deviation; \"- fp32\" is each seed's run minus its fp32 run",
        seeds.len()
    );
    println!(
        "{:<9} {:>19} {:>19} {:>19} {:>19} {:>8} {:>9}",
        "run", "gap to floor", "accuracy %", "gap - fp32", "accuracy - fp32", "skipped", "speed-up"
    );
    for (i, name) in seeds[0].runs.iter().map(|r| &r.name).enumerate() {
        let of = |f: &dyn Fn(&Run) -> f64| seeds.iter().map(|s| f(&s.runs[i])).collect::<Vec<_>>();
        let paired = |f: &dyn Fn(&Run) -> f64| {
            seeds
                .iter()
                .filter_map(|s| fp32_of(&s.runs).map(|fp32| f(&s.runs[i]) - f(fp32)))
                .collect::<Vec<_>>()
        };
        let gap = |r: &Run| r.final_loss() - floor;
        let accuracy = |r: &Run| r.accuracy;
        let is_fp32 = name.starts_with("fp32");
        let vs_fp32 = |f: &dyn Fn(&Run) -> f64, scale, digits| {
            let d = paired(f);
            if is_fp32 || d.is_empty() {
                "-".to_string()
            } else {
                pm(mean_sd(&d), scale, digits, true)
            }
        };
        let mut speedups = paired(&|r: &Run| r.median_ms().ln());
        speedups.sort_by(f64::total_cmp);
        let speedup = match speedups.get(speedups.len() / 2) {
            Some(log_ratio) if !is_fp32 => format!("{:.2}x", (-log_ratio).exp()),
            _ => "-".to_string(),
        };
        println!(
            "{name:<9} {:>19} {:>19} {:>19} {:>19} {:>8} {speedup:>9}",
            pm(mean_sd(&of(&gap)), 1.0, 4, false),
            pm(mean_sd(&of(&accuracy)), 100.0, 2, false),
            vs_fp32(&gap, 1.0, 4),
            vs_fp32(&accuracy, 100.0, 2),
            of(&|r: &Run| r.skipped as f64).iter().sum::<f64>(),
        );
    }
    println!();
}

/// One seed's runs for results.json.
pub fn seed_json(seed: &Seed, tokens: usize, floor: f64) -> serde_json::Value {
    let fp32_ms = fp32_of(&seed.runs).map(Run::median_ms);
    let runs: Vec<_> = seed
        .runs
        .iter()
        .map(|run| {
            let ms = run.median_ms();
            serde_json::json!({
                "run": run.name, "median_step_ms": ms, "tokens_per_s": tokens as f64 / (ms / 1e3),
                "final_loss": run.final_loss(), "gap_to_floor": run.final_loss() - floor,
                "accuracy": run.accuracy, "skipped_steps": run.skipped, "final_scale": run.scale,
                "speedup_vs_fp32": fp32_ms.map(|f| f / ms), "param_bytes": run.bytes,
                "loss_curve": run.curve,
            })
        })
        .collect();
    serde_json::json!({ "seed": seed.seed, "oracle_eval_accuracy": seed.oracle, "runs": runs })
}
