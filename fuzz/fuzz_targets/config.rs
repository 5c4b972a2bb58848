//! The sidecar's config file: any text gives a config or field errors, never a panic, and the
//! answer does not depend on anything but the text.
#![no_main]

use std::path::Path;

use aether_proxy::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = Path::new("fuzz.yaml");
    match Config::parse(file, text) {
        Ok(cfg) => {
            // Parsing is a pure function of the text.
            let again = Config::parse(file, text).expect("second parse refused");
            assert_eq!(format!("{cfg:?}"), format!("{again:?}"));
            for p in &cfg.inbound.ports {
                assert!(cfg.inbound_port(p.port).is_some());
            }
        }
        Err(errs) => {
            assert!(!errs.0.is_empty(), "refused without a reason");
            let shown = errs.to_string();
            assert!(
                shown.contains("fuzz.yaml"),
                "error does not name the file: {shown}"
            );
        }
    }
});
