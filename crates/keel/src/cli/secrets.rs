//! keel's secrets, out of the environment block it was started with.
//!
//! `/proc/<pid>/environ` shows the block the kernel wrote when the process started, whatever
//! `setenv` did since. A tool running as root (root reads every process's files) could find
//! keel's API token, JWT secret or provider keys there. So at start-up, while keel has a single
//! thread, each secret present ([`keel_core::env::SECRETS`]) is set again (the C library copies
//! it to the heap, where keel's own reads find it) and its original bytes are zeroed.

#![allow(unsafe_code, reason = "the original environment block is reachable only through `environ`")]

use std::ffi::{CStr, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;

unsafe extern "C" {
    /// The C library's environment: a NULL-terminated array of `NAME=value` strings.
    static environ: *const *mut libc::c_char;
}

/// Moves the secrets out of the original block. Must run before any other thread starts.
pub(crate) fn scrub_environment_block() {
    // (the original string, where its value starts, the value's length, name, value)
    let mut found: Vec<(*mut libc::c_char, usize, usize, OsString, OsString)> = Vec::new();
    // SAFETY: `environ` is a valid NULL-terminated array of NUL-terminated strings, and no
    // other thread exists to change it while it is read.
    unsafe {
        let mut entry = environ;
        while !entry.is_null() && !(*entry).is_null() {
            let bytes = CStr::from_ptr(*entry).to_bytes();
            if let Some(equals) = bytes.iter().position(|b| *b == b'=') {
                let name = &bytes[..equals];
                if std::str::from_utf8(name).is_ok_and(keel_core::env::is_secret) {
                    let value = &bytes[equals + 1..];
                    found.push((
                        *entry,
                        equals + 1,
                        value.len(),
                        OsStr::from_bytes(name).to_owned(),
                        OsStr::from_bytes(value).to_owned(),
                    ));
                }
            }
            entry = entry.add(1);
        }
    }
    for (original, value_at, length, name, value) in found {
        // SAFETY: keel has a single thread (this runs first in `main`), so nothing reads or
        // writes the environment concurrently. `setenv` points `environ` at a new copy; the
        // original string is no longer referenced, and its value's bytes are ours to zero.
        unsafe {
            std::env::set_var(&name, &value);
            std::ptr::write_bytes(original.add(value_at), 0, length);
        }
    }
}
