//! `Policy` and `OptLevel` parsing on arbitrary strings: never a panic; a policy that parses prints
//! back to a string that parses to the same policy; an error names the whole input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    match text.parse::<amp::Policy>() {
        Ok(policy) => assert_eq!(policy.to_string().parse::<amp::Policy>().ok(), Some(policy)),
        Err(err) => assert!(err.to_string().contains(text), "{err}"),
    }
    let _ = text.parse::<amp::OptLevel>();
});
