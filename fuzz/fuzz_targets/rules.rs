//! Any text as a rules file: the loader must answer with rules or errors, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        match turnstile::config::load_str("fuzz.yaml", text) {
            Ok(rules) => {
                let _ = rules.describe();
            }
            Err(errors) => assert!(!errors.0.is_empty()),
        }
    }
});
