//! Request bodies of `/v1/completions` and `/v1/chat/completions`, through the same
//! `parse_request` the handlers call: any bytes must give a request or an `ApiError` that names
//! a 4xx status, never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use moeserve_server::openai::{chat, completions};

fuzz_target!(|body: &[u8]| {
    for result in [
        completions::parse_request(body).map(|_| ()),
        chat::parse_request(body).map(|_| ()),
    ] {
        if let Err(error) = result {
            let status = error.status().as_u16();
            assert!(
                (400..500).contains(&status),
                "{status} for a bad body: {error:?}"
            );
            assert!(!error.body().message.is_empty());
        }
    }
});
