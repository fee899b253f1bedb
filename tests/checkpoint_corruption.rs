//! Damaged checkpoints are refused, never a panic: a real checkpoint (model, AdamW state, scaler state)
//! truncated, with flipped header bytes, wrong dtypes, shapes that overflow, huge declared sizes,
//! metadata that is not the JSON object expected, states that break the scaler's or the optimizer's
//! invariants, and masters or moments that hold inf/NaN. Every case returns an error naming the file
//! and the problem, and the model and states are unchanged (`corpus/checkpoint_case.rs`).
//!
//! `AMP_WRITE_CORPUS=1 cargo test --test checkpoint_corruption` also writes the cases to
//! `tests/corpus/checkpoint/`, the fuzzer's seeds and `tests/checkpoint_corpus.rs`'s regression cases.

#[path = "corpus/checkpoint_case.rs"]
mod checkpoint_case;

use std::path::{Path, PathBuf};

use amp::AmpModuleExt;
use candle_core::{Device, Module, Tensor};
use checkpoint_case::{check_case, fresh};
use serde_json::{json, Value};

type Outcome<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// A file name unique to this call (the tests run in parallel threads of one process).
fn scratch(name: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("amp-corrupt-{}-{call}-{name}.safetensors", std::process::id()))
}

/// A checkpoint after three training steps, as bytes; `poison` changes the model first.
fn real_checkpoint(poison: impl Fn(&checkpoint_case::Model) -> Outcome) -> Outcome<Vec<u8>> {
    let (model, mut adam, mut scaler) = fresh()?;
    let x = Tensor::arange(0f32, 12.0, &Device::Cpu)?.reshape((3, 4))?.sin()?;
    for _ in 0..3 {
        let out = model[1].forward(&model[0].forward(&x)?.tanh()?)?;
        let loss = out.sqr()?.mean_all()?;
        scaler.step_fused(&loss, &mut adam, None)?;
    }
    poison(&model)?;
    let path = scratch("real");
    amp::checkpoint::save_with(&model, &[&adam, &scaler], &path)?;
    let bytes = std::fs::read(&path)?;
    std::fs::remove_file(&path)?;
    Ok(bytes)
}

/// The header (JSON) and the data of a safetensors file.
fn split(bytes: &[u8]) -> Outcome<(Value, Vec<u8>)> {
    let n = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    Ok((serde_json::from_slice(&bytes[8..8 + n])?, bytes[8 + n..].to_vec()))
}

fn assemble(header: &Value, data: &[u8]) -> Vec<u8> {
    let text = header.to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

/// The real checkpoint with its header changed by `edit` and amp's checksum left out, as a file written
/// by other code would be, so that the checks of what was edited are what refuses it (with the checksum
/// in place, it refuses every edit first: `an_edit_under_the_checksum_is_refused`).
fn edited(real: &[u8], edit: impl FnOnce(&mut Value)) -> Outcome<Vec<u8>> {
    let (mut header, data) = split(real)?;
    if let Some(metadata) = header.get_mut("__metadata__").and_then(Value::as_object_mut) {
        metadata.remove("amp_data_crc32");
        metadata.remove("amp_table_crc32");
    }
    edit(&mut header);
    Ok(assemble(&header, &data))
}

/// A bad case and a fragment its error must contain.
struct Case {
    name: String,
    bytes: Vec<u8>,
    expect: &'static str,
}

fn case(name: &str, bytes: Vec<u8>, expect: &'static str) -> Case {
    Case { name: name.to_string(), bytes, expect }
}

/// Loads `bytes`, checks the promise, returns the error message (None when it loaded).
fn refusal(name: &str, bytes: &[u8]) -> Option<String> {
    let path = scratch(name);
    let loaded = check_case(bytes, &path).unwrap_or_else(|broken| panic!("{name}: {broken}"));
    let message = (!loaded).then(|| {
        let (mut model, mut adam, mut scaler) = fresh().expect("a fresh model");
        let err = amp::checkpoint::load_with(&mut model, &mut [&mut adam, &mut scaler], &path);
        err.expect_err("refused again").to_string()
    });
    std::fs::remove_file(&path).ok();
    message
}

fn header_cases(real: &[u8]) -> Outcome<Vec<Case>> {
    let names = || -> Outcome<(String, String)> {
        let (header, _) = split(real)?;
        let object = header.as_object().ok_or("header is an object")?;
        let master = object.keys().find(|k| !k.starts_with("amp_state") && *k != "__metadata__");
        let moment = object.keys().find(|k| k.ends_with("/exp_avg"));
        Ok((master.ok_or("a master")?.clone(), moment.ok_or("a moment")?.clone()))
    };
    let (master, moment) = names()?;
    let set_meta =
        |key: &'static str, value: &'static str| edited(real, move |h| h["__metadata__"][key] = json!(value));
    Ok(vec![
        case(
            "wrong_dtype_master_i32",
            edited(real, |h| h[&master]["dtype"] = json!("I32"))?,
            "is I32 in the checkpoint",
        ),
        case("wrong_dtype_master_f16", edited(real, |h| h[&master]["dtype"] = json!("F16"))?, "safetensor"),
        case(
            "wrong_dtype_moment_i32",
            edited(real, |h| h[&moment]["dtype"] = json!("I32"))?,
            "the saved settings keep this state in F32",
        ),
        case("unknown_dtype", edited(real, |h| h[&master]["dtype"] = json!("F128"))?, "checkpoint"),
        case(
            "shape_overflows",
            edited(real, |h| h[&master]["shape"] = json!([1u64 << 40, 1u64 << 40, 1u64 << 40]))?,
            "overflow",
        ),
        case("shape_wrong", edited(real, |h| h[&master]["shape"] = json!([2, 1]))?, "safetensor"),
        case(
            "offsets_huge",
            edited(real, |h| h[&master]["data_offsets"] = json!([0, 1u64 << 62]))?,
            "safetensor",
        ),
        case("metadata_array", edited(real, |h| h["__metadata__"] = json!([1, 2]))?, "checkpoint"),
        case("metadata_state_array", set_meta("amp_state/scaler", "[1, 2]")?, "`scaler` state"),
        case("metadata_state_number", set_meta("amp_state/optimizer", "42")?, "`optimizer` state"),
        case("metadata_state_null", set_meta("amp_state/scaler", "null")?, "`scaler` state"),
        case("metadata_state_empty_object", set_meta("amp_state/optimizer", "{}")?, "missing field"),
        case(
            "metadata_state_missing",
            edited(real, |h| {
                h["__metadata__"]
                    .as_object_mut()
                    .map(|m| m.remove("amp_state/scaler"))
                    .map(drop)
                    .unwrap_or(())
            })?,
            "no `scaler` state",
        ),
        case("header_length_max", [&u64::MAX.to_le_bytes()[..], &real[8..]].concat(), "header too large"),
        case(
            "header_length_huge",
            [&(1u64 << 40).to_le_bytes()[..], &real[8..]].concat(),
            "header too large",
        ),
        case(
            "header_length_past_end",
            [&(real.len() as u64).to_le_bytes()[..], &real[8..]].concat(),
            "invalid header length",
        ),
        case("header_not_json", [&4u64.to_le_bytes()[..], b"{{{{"].concat(), "invalid JSON"),
        case("header_not_utf8", [&2u64.to_le_bytes()[..], &[0xff, 0xfe]].concat(), "UTF-8"),
    ])
}

/// Saved states whose JSON parses but breaks an invariant.
fn state_cases(real: &[u8]) -> Outcome<Vec<Case>> {
    let (header, _) = split(real)?;
    let scaler: Value =
        serde_json::from_str(header["__metadata__"]["amp_state/scaler"].as_str().ok_or("scaler")?)?;
    let optimizer: Value =
        serde_json::from_str(header["__metadata__"]["amp_state/optimizer"].as_str().ok_or("optimizer")?)?;
    let with = |key: &'static str, base: &Value, edit: &dyn Fn(&mut Value)| -> Outcome<Vec<u8>> {
        let mut state = base.clone();
        edit(&mut state);
        edited(real, |h| h["__metadata__"][key] = json!(state.to_string()))
    };
    let scaler_key = "amp_state/scaler";
    let opt_key = "amp_state/optimizer";
    let first_param =
        optimizer["group_of"].as_object().and_then(|m| m.keys().next().cloned()).ok_or("group_of")?;
    // A moment of a matrix that is not square, its shape read the other way round (the same bytes).
    let matrix_moment = header
        .as_object()
        .ok_or("header is an object")?
        .iter()
        .find(|(k, v)| {
            k.ends_with("/exp_avg") && v["shape"].as_array().is_some_and(|s| s.len() == 2 && s[0] != s[1])
        })
        .map(|(k, v)| (k.clone(), v["shape"].clone()))
        .ok_or("a matrix's moment")?;
    Ok(vec![
        case(
            "optimizer_param_in_another_group",
            with(opt_key, &optimizer, &|s| s["group_of"][&first_param] = json!(1))?,
            "was in parameter group 1 when saved and is in group 0 now",
        ),
        case(
            "optimizer_param_unknown",
            with(opt_key, &optimizer, &|s| {
                let map = s["group_of"].as_object_mut().expect("group_of is an object");
                let group = map.remove(&first_param).expect("the first parameter");
                map.insert("renamed.weight".into(), group);
            })?,
            "was not one of its parameters when saved",
        ),
        case(
            "optimizer_moment_transposed",
            edited(real, |h| {
                let (name, shape) = &matrix_moment;
                h[name]["shape"] = json!([shape[1], shape[0]]);
            })?,
            "saved state is matched to parameters by name",
        ),
        case(
            "scaler_tracker_max",
            with(scaler_key, &scaler, &|s| s["state"]["growth_tracker"] = json!(u32::MAX))?,
            "growth_tracker",
        ),
        case(
            "scaler_scale_above_max",
            with(scaler_key, &scaler, &|s| s["state"]["scale"] = json!(1e30))?,
            "outside [min_scale",
        ),
        case(
            "scaler_scale_negative",
            with(scaler_key, &scaler, &|s| s["state"]["scale"] = json!(-1.0))?,
            "outside [min_scale",
        ),
        case(
            "scaler_steps_mismatch",
            with(scaler_key, &scaler, &|s| s["state"]["steps"] = json!(u64::MAX))?,
            "skipped",
        ),
        case(
            "scaler_bad_factor",
            with(scaler_key, &scaler, &|s| s["config"]["backoff_factor"] = json!(2.0))?,
            "backoff_factor",
        ),
        case(
            "scaler_interval_zero",
            with(scaler_key, &scaler, &|s| s["config"]["growth_interval"] = json!(0))?,
            "growth_interval",
        ),
        case("optimizer_step_max", with(opt_key, &optimizer, &|s| s["step"] = json!(u64::MAX))?, "u64::MAX"),
        case(
            "optimizer_groups_none",
            with(opt_key, &optimizer, &|s| s["groups"] = json!([]))?,
            "parameter group",
        ),
        case(
            "optimizer_lr_negative",
            with(opt_key, &optimizer, &|s| s["config"]["lr"] = json!(-1.0))?,
            "`lr` must be finite and at least 0",
        ),
        case(
            "optimizer_beta_one",
            with(opt_key, &optimizer, &|s| s["config"]["beta2"] = json!(1.0))?,
            "`beta2` must be in [0, 1)",
        ),
        case(
            "optimizer_group_lr_negative",
            with(opt_key, &optimizer, &|s| s["groups"][0]["lr"] = json!(-0.5))?,
            "`groups[0].lr`",
        ),
        case(
            "optimizer_amsgrad_without_its_buffer",
            with(opt_key, &optimizer, &|s| s["config"]["amsgrad"] = json!(true))?,
            "max_exp_avg_sq` is missing",
        ),
        case(
            "optimizer_config_not_object",
            with(opt_key, &optimizer, &|s| s["config"] = json!("adam"))?,
            "state in the checkpoint is unreadable",
        ),
    ])
}

/// A master with a NaN and an inf (saved from a model), and a moment with an inf (written into the
/// real checkpoint's data).
fn non_finite_cases(real: &[u8]) -> Outcome<Vec<Case>> {
    let nan_master = real_checkpoint(|model| {
        let master = model[0].weight().master();
        let mut values = master.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        (values[3], values[5]) = (f32::NAN, f32::INFINITY);
        master.set(&Tensor::from_vec(values, master.shape(), &Device::Cpu)?)?;
        Ok(())
    })?;
    let (mut header, mut data) = split(real)?;
    let moment =
        header.as_object().and_then(|h| h.keys().find(|k| k.ends_with("/exp_avg_sq"))).ok_or("a moment")?;
    let start = header[moment]["data_offsets"][0].as_u64().ok_or("an offset")? as usize;
    data[start..start + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    // Without the data's checksum, as a file written by other code would be: the scan of the values
    // finds the inf (with it, the checksum refuses the edited data first: `data_flips`).
    header["__metadata__"].as_object_mut().ok_or("metadata")?.remove("amp_data_crc32").ok_or("a checksum")?;
    Ok(vec![
        case("non_finite_master", nan_master, "holds 2 non-finite value(s)"),
        case("non_finite_moment", assemble(&header, &data), "exp_avg_sq` holds 1 non-finite value(s)"),
    ])
}

/// Every prefix length around the header's end, and a few inside the data.
fn truncations(real: &[u8]) -> Vec<Case> {
    let header_end = 8 + u64::from_le_bytes(real[..8].try_into().expect("8 bytes")) as usize;
    let mut lengths: Vec<usize> = (0..16).chain(header_end - 16..header_end + 16).collect();
    lengths.extend([real.len() / 2, real.len() - 4, real.len() - 1]);
    lengths.into_iter().map(|n| case(&format!("truncated_{n}"), real[..n].to_vec(), "checkpoint")).collect()
}

/// Every header byte flipped (ASCII case, quote, brace, digit and separator damage), one at a time.
fn flips(real: &[u8]) -> Vec<Case> {
    let header_end = 8 + u64::from_le_bytes(real[..8].try_into().expect("8 bytes")) as usize;
    (0..header_end)
        .map(|i| {
            let mut bytes = real.to_vec();
            bytes[i] ^= 0x20;
            case(&format!("flip_{i}"), bytes, "")
        })
        .collect()
}

/// Every byte of the tensor data flipped, one at a time: the checksum saved in the header refuses each.
fn data_flips(real: &[u8]) -> Vec<Case> {
    let header_end = 8 + u64::from_le_bytes(real[..8].try_into().expect("8 bytes")) as usize;
    (header_end..real.len())
        .map(|i| {
            let mut bytes = real.to_vec();
            bytes[i] ^= 0x01;
            case(&format!("data_flip_{i}"), bytes, "do not match the checksum saved with them")
        })
        .collect()
}

fn write_corpus(cases: &[Case], real: &[u8]) -> Outcome {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/checkpoint");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("valid.safetensors"), real)?;
    // A sample of the flips keeps the corpus small; the fuzzer's merge adds what it finds.
    let sampled = |c: &&Case| {
        !(c.name.starts_with("flip_") || c.name.starts_with("data_flip_")) || c.name.ends_with("00")
    };
    for case in cases.iter().filter(sampled) {
        std::fs::write(dir.join(format!("{}.safetensors", case.name)), &case.bytes)?;
    }
    Ok(())
}

#[test]
fn damaged_checkpoints_are_refused_with_the_file_and_the_problem_named() -> Outcome {
    let real = real_checkpoint(|_| Ok(()))?;
    assert_eq!(refusal("valid", &real), None, "the undamaged checkpoint loads");
    let mut cases = header_cases(&real)?;
    cases.extend(state_cases(&real)?);
    cases.extend(non_finite_cases(&real)?);
    cases.extend(truncations(&real));
    let data_flipped = data_flips(&real);
    let data_flips_refused = data_flipped.len();
    cases.extend(data_flipped);
    let mut refused = 0;
    for case in &cases {
        let message = refusal(&case.name, &case.bytes).unwrap_or_else(|| panic!("{}: loaded", case.name));
        assert!(message.contains(case.expect), "{}: expected {:?} in: {message}", case.name, case.expect);
        refused += 1;
    }
    let flipped = flips(&real);
    let flips_refused = flipped.iter().filter(|c| refusal(&c.name, &c.bytes).is_some()).count();
    println!(
        "damaged checkpoints: {} structured cases refused, and all {data_flips_refused} single-bit flips of the \
         tensor data (by the checksum); {flips_refused} of {} single-byte header flips refused; no panic, \
         every refusal names the file and changes nothing",
        refused - data_flips_refused,
        flipped.len()
    );
    cases.extend(flipped);
    if std::env::var_os("AMP_WRITE_CORPUS").is_some() {
        write_corpus(&cases, &real)?;
    }
    Ok(())
}

/// Two same-shaped tensors (a parameter's two Adam moments) read from each other's bytes: every name,
/// shape and value is plausible, and the data's checksum still matches; the table's checksum refuses it.
/// Without it (a file from before it was saved) the swap would load.
#[test]
fn a_tensor_table_edited_under_the_checksum_is_refused() -> Outcome {
    let real = real_checkpoint(|_| Ok(()))?;
    let (mut header, data) = split(&real)?;
    let first = header
        .as_object()
        .ok_or("header is an object")?
        .keys()
        .find(|k| k.ends_with("/exp_avg"))
        .ok_or("a moment")?
        .clone();
    let second = format!("{first}_sq");
    let (a, b) = (header[&first]["data_offsets"].clone(), header[&second]["data_offsets"].clone());
    header[&first]["data_offsets"] = b;
    header[&second]["data_offsets"] = a;
    let swapped = assemble(&header, &data);
    let message = refusal("table_swapped", &swapped).ok_or("loaded")?;
    assert!(message.contains("amp_table_crc32") && message.contains("tensor table"), "{message}");
    let metadata = header["__metadata__"].as_object_mut().ok_or("metadata")?;
    assert!(metadata.remove("amp_table_crc32").is_some(), "amp writes the table's checksum");
    assert_eq!(refusal("table_swapped_unchecked", &assemble(&header, &data)), None, "what it catches");
    Ok(())
}

/// A training state edited in place, its checksum kept (a learning rate changed by hand, a bit flipped
/// by the disk): refused by the checksum of the data and the states, naming the file.
#[test]
fn an_edit_under_the_checksum_is_refused() -> Outcome {
    let real = real_checkpoint(|_| Ok(()))?;
    let (mut header, data) = split(&real)?;
    let metadata = header["__metadata__"].as_object_mut().ok_or("metadata")?;
    assert!(metadata.contains_key("amp_data_crc32"), "amp writes a checksum");
    let key = metadata.keys().find(|k| k.starts_with("amp_state/")).ok_or("a state")?.clone();
    let json = metadata[&key].as_str().ok_or("a JSON string")?.replacen("0.", "0.5", 1);
    metadata.insert(key, Value::String(json));
    let message = refusal("state_edited", &assemble(&header, &data)).ok_or("loaded")?;
    assert!(message.contains("do not match the checksum saved with them"), "{message}");
    Ok(())
}

#[test]
fn non_finite_masters_are_refused_by_default_and_load_for_inspection() -> Outcome {
    let real = real_checkpoint(|_| Ok(()))?;
    let bytes = non_finite_cases(&real)?.remove(0).bytes;
    let path = scratch("inspect");
    std::fs::write(&path, &bytes)?;
    let (mut model, mut adam, mut scaler) = fresh()?;
    let err = amp::checkpoint::load_with(&mut model, &mut [&mut adam, &mut scaler], &path).unwrap_err();
    let name = model.named_params()[0].0.clone();
    assert!(
        err.to_string().contains(&format!("`{name}` holds 2 non-finite value(s) (inf/NaN) of 32")),
        "{err}"
    );
    let options = amp::checkpoint::LoadOptions { allow_non_finite: true };
    amp::checkpoint::load_with_options(&mut model, &mut [&mut adam, &mut scaler], &path, options)?;
    let values = model[0].weight().master().as_tensor().flatten_all()?.to_vec1::<f32>()?;
    assert!(values[3].is_nan() && values[5] == f32::INFINITY, "loaded as saved, for inspection");
    std::fs::remove_file(&path)?;
    Ok(())
}
