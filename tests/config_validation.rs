//! Policy strings and every config's `validate`, property-tested: no input panics; a policy that parses
//! prints back to itself; every refusal names the input and the part or field that is wrong. Also
//! replays the policy fuzzer's regression corpus (`tests/corpus/policy/`).

use amp::optim::{AdamConfig, LambConfig, SgdConfig};
use amp::scaler::ScalerConfig;
use amp::{OptLevel, Policy};
use proptest::prelude::*;

const KEYS: [&str; 7] = ["params", "p", "compute", "c", "output", "o", "param"];
const SPECS: [&str; 8] = ["fp32", "f32", "fp16", "float16", "bf16", "bfloat16", "half", "float32"];

/// What a policy item is made of: a key (valid or not) and a precision (valid or not).
fn item() -> impl Strategy<Value = (String, String)> {
    let key =
        prop_oneof![4 => proptest::sample::select(KEYS.to_vec()).prop_map(String::from), 1 => "[a-z]{1,4}"];
    let spec = prop_oneof![4 => proptest::sample::select(SPECS.to_vec()).prop_map(String::from), 1 => "[a-z0-9]{0,5}"];
    (key, spec)
}

fn slot(key: &str) -> Option<usize> {
    match key {
        "params" | "param" | "p" => Some(0),
        "compute" | "c" => Some(1),
        "output" | "o" => Some(2),
        _ => None,
    }
}

proptest! {
    #[test]
    fn any_string_parses_or_is_refused_naming_it(text in any::<String>()) {
        match text.parse::<Policy>() {
            Ok(policy) => prop_assert_eq!(policy.to_string().parse::<Policy>().ok(), Some(policy)),
            Err(err) => prop_assert!(err.to_string().contains(&text), "{}", err),
        }
        if let Err(err) = text.parse::<OptLevel>() {
            prop_assert!(err.to_string().contains(text.trim()), "{}", err);
        }
    }

    #[test]
    fn a_bad_policy_item_is_named(items in proptest::collection::vec(item(), 1..5)) {
        let text = items.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
        let mut seen = [false; 3];
        // The first problem, in the parser's order: unknown key, repeated key, bad precision.
        let mut first_problem = None;
        for (index, (key, spec)) in items.iter().enumerate() {
            let Some(slot) = slot(key) else {
                first_problem = Some(format!("unknown key `{key}` in item {}", index + 1));
                break;
            };
            if std::mem::replace(&mut seen[slot], true) {
                first_problem = Some("is given twice".to_string());
                break;
            }
            if spec.parse::<amp::PrecisionSpec>().is_err() {
                first_problem = Some(format!("in `{key}={spec}`"));
                break;
            }
        }
        match (text.parse::<Policy>(), first_problem) {
            (Ok(_), None) => {}
            (Err(err), Some(problem)) => {
                let message = err.to_string();
                prop_assert!(message.contains(&problem) && message.contains(&text), "{} lacks {}", message, problem);
            }
            (result, problem) => prop_assert!(false, "{:?}: got {:?}, expected problem {:?}", text, result, problem),
        }
    }

    #[test]
    fn a_bad_scaler_setting_is_named(field in 0usize..6, bad in prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(0.0f32), Just(-1.0f32)]) {
        let mut config = ScalerConfig::default();
        let name = match field {
            0 => { config.init_scale = bad; "init_scale" }
            1 => { config.growth_factor = if bad == 0.0 { 1.0 } else { bad }; "growth_factor" }
            2 => { config.backoff_factor = if bad == 0.0 { 1.0 } else { bad }; "backoff_factor" }
            3 => { config.min_scale = bad; "min_scale" }
            4 => { config.max_scale = if bad == 0.0 { f32::INFINITY } else { bad }; "max_scale" }
            _ => { config.growth_interval = 0; "growth_interval" }
        };
        let err = config.validate().expect_err("refused").to_string();
        prop_assert!(err.contains(name), "{}: {}", name, err);
        prop_assert!(amp::GradScaler::new(config).is_err());
    }

    #[test]
    fn a_bad_optimizer_setting_is_named(field in 0usize..5, bad in prop_oneof![Just(f64::NAN), Just(f64::INFINITY), Just(-0.5), Just(1.0), Just(0.0)]) {
        let (mut adam, mut lamb, mut sgd) = (AdamConfig::default(), LambConfig::default(), SgdConfig::default());
        let name = ["lr", "beta1", "beta2", "eps", "weight_decay"][field];
        match field {
            0 => (adam.lr, lamb.lr, sgd.lr) = (bad, bad, bad),
            1 => (adam.beta1, lamb.beta1, sgd.momentum) = (bad, bad, bad),
            2 => (adam.beta2, lamb.beta2, sgd.dampening) = (bad, bad, bad),
            3 => (adam.eps, lamb.eps) = (bad, bad),
            _ => (adam.weight_decay, lamb.weight_decay, sgd.weight_decay) = (bad, bad, bad),
        }
        // Which values each field accepts: rates and decays >= 0 and finite, decays below 1, eps > 0.
        let ok = match field {
            0 | 4 => bad.is_finite() && bad >= 0.0,
            1 | 2 => (0.0..1.0).contains(&bad),
            _ => bad.is_finite() && bad > 0.0,
        };
        for (what, result) in [("AdamConfig", adam.validate()), ("LambConfig", lamb.validate())] {
            match result {
                Ok(()) => prop_assert!(ok, "{} accepted {} = {}", what, name, bad),
                Err(err) => prop_assert!(!ok && err.to_string().contains(&format!("`{name}`")), "{}: {}", what, err),
            }
        }
        let sgd_name = ["lr", "momentum", "dampening", "eps", "weight_decay"][field];
        let sgd_ok = match field {
            0 | 1 | 4 => bad.is_finite() && bad >= 0.0,
            2 => (0.0..=1.0).contains(&bad),
            _ => true,
        };
        match sgd.validate() {
            Ok(()) => prop_assert!(sgd_ok, "SgdConfig accepted {} = {}", sgd_name, bad),
            Err(err) => prop_assert!(!sgd_ok && err.to_string().contains(&format!("`{sgd_name}`")), "{}", err),
        }
    }
}

#[test]
fn the_policy_fuzzers_corpus_is_refused_or_parsed_cleanly() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/policy");
    let (mut parsed, mut refused) = (0, 0);
    for entry in std::fs::read_dir(dir)? {
        let bytes = std::fs::read(entry?.path())?;
        let Ok(text) = std::str::from_utf8(&bytes) else { continue };
        match text.parse::<Policy>() {
            Ok(policy) => {
                assert_eq!(policy.to_string().parse::<Policy>()?, policy);
                parsed += 1;
            }
            Err(err) => {
                assert!(err.to_string().contains(text), "{err}");
                refused += 1;
            }
        }
    }
    println!("policy corpus: {parsed} parsed, {refused} refused with the input named");
    assert!(parsed > 0 && refused > 0);
    Ok(())
}

#[test]
fn nesterov_without_momentum_is_refused_naming_it() {
    let config = SgdConfig { nesterov: true, ..Default::default() };
    assert!(config.validate().unwrap_err().to_string().contains("`nesterov`"));
}

/// A first scale outside the scale's bounds is refused (it was moved inside them without a word), and
/// `ScalerConfig::fixed` widens the bounds to hold its scale.
#[test]
fn an_init_scale_outside_the_bounds_is_refused_and_a_fixed_scale_is_kept() -> amp::Result<()> {
    for init_scale in [0.5, 2f32.powi(25)] {
        let config = ScalerConfig { init_scale, ..Default::default() };
        let err = config.validate().expect_err("outside [1, 2^24]").to_string();
        assert!(err.contains("init_scale") && err.contains("min_scale or raise max_scale"), "{err}");
        assert_eq!(amp::GradScaler::new(ScalerConfig::fixed(init_scale))?.scale(), init_scale);
    }
    Ok(())
}
