//! Two reviews, as tests, of the functions the library hands to C (exported hooks, entry
//! points handed out by lookups, `atexit` and signal handlers, host functions, load-time
//! constructors):
//! - every one runs its Rust code inside a panic boundary. A panic that leaves such a function
//!   aborts the process it is loaded into; so a new one without a boundary fails here until it
//!   gets one, or a line in `EXEMPT` saying why it needs none;
//! - every public one (an exported hook, or one handed out in place of the driver's) has a row
//!   in docs/contract.md's tables, which say what expseg does with each intercepted call.

use std::path::{Path, PathBuf};

/// Calls that catch a panic: the hooks' boundaries (`hooks/guard.rs`) and `catch_unwind`.
const MARKERS: &[&str] = &[
    "boundary(",
    "driver_boundary(",
    "around_real(",
    "contained(",
    "catch_unwind(",
];

/// Functions without a boundary of their own, by file (under `src/`) and name, and why.
const EXEMPT: &[(&str, &str, &str)] = &[
    ("dlsym.rs", "dlsym", "a naked trampoline (assembly only); the Rust it calls, expseg_dlsym_redirect, is checked"),
    ("syscall_hook.rs", "syscall", "a naked trampoline (assembly only); the Rust it calls, expseg_syscall_first and expseg_pidfd_getfd, is checked"),
    ("syscall_hook.rs", "expseg_raw_syscall", "the system call instruction and an errno store"),
    ("api/state.rs", "child_after_fork", "one atomic store"),
    ("pyapi.rs", "expseg_version", "returns a static string"),
    ("hooks/mod.rs", "cudaMemGetInfo", "expseg's part runs in mem_get_info(), which catches around it; the runtime's call is made in any case"),
    ("hooks/mod.rs", "cuMemUnmap", "expseg's part runs in api::unmap_unserved, which catches around it; the driver's call is made in any case"),
    ("hooks/query.rs", "cuMemGetAddressRange_v2", "expseg's part runs in ours(), which catches; the rest is the driver's call and writes of the answer"),
    ("hooks/query.rs", "cuPointerGetAttribute", "expseg's part runs in ours(), foreign_mapping() and legacy_ipc_capable(), which catch; the rest is the driver's call"),
    ("hooks/query.rs", "cuPointerGetAttributes", "expseg's part runs in ours(), foreign_mapping() and legacy_ipc_capable(), which catch; the rest is the driver's call"),
    ("vmm_hooks.rs", "cuMulticastBindMem", "expseg's part runs in real_handle(), which catches"),
    ("vmm_hooks.rs", "cuMulticastBindAddr", "expseg's part runs in pin_pages(), which catches"),
    ("hooks/order.rs", "ctx_sync_slot", ORDER),
    ("hooks/order.rs", "stream_sync_slot", ORDER),
    ("hooks/order.rs", "event_sync_slot", ORDER),
    ("hooks/order.rs", "record_slot", ORDER),
    ("hooks/order.rs", "record_flags_slot", ORDER),
    ("hooks/order.rs", "ipc_event_slot", ORDER),
    ("hooks/order.rs", "cuCtxSynchronize", ORDER),
    ("hooks/order.rs", "cuStreamSynchronize", ORDER),
    ("hooks/order.rs", "cuStreamSynchronize_ptsz", ORDER),
    ("hooks/order.rs", "cuEventSynchronize", ORDER),
    ("hooks/order.rs", "cuEventRecord", ORDER),
    ("hooks/order.rs", "cuEventRecord_ptsz", ORDER),
    ("hooks/order.rs", "cuEventRecordWithFlags", ORDER),
    ("hooks/order.rs", "cuEventRecordWithFlags_ptsz", ORDER),
    ("hooks/order.rs", "cuIpcGetEventHandle", ORDER),
    ("hooks/order.rs", "import_slot", "one atomic store (api::sharing), then the driver's call"),
    ("hooks/order.rs", "export_slot", "one atomic store (api::sharing), then the driver's call"),
    ("hooks/order.rs", "range_handle_slot", "expseg's part in range_asked(): around_real(), which catches; then the driver's call"),
    ("hooks/order.rs", "cuMemGetHandleForAddressRange", "expseg's part in range_asked(): around_real(), which catches; then the driver's call"),
    ("hooks/streams.rs", "create_slot", STREAMS),
    ("hooks/streams.rs", "create_prio_slot", STREAMS),
    ("hooks/streams.rs", "destroy_slot", STREAMS),
    ("hooks/streams.rs", "cuStreamCreate", STREAMS),
    ("hooks/streams.rs", "cuStreamCreateWithPriority", STREAMS),
    ("hooks/streams.rs", "cuStreamDestroy", STREAMS),
    ("hooks/streams.rs", "cuStreamDestroy_v2", STREAMS),
];

/// Why the stream hooks (src/hooks/streams.rs) need no boundary of their own.
const STREAMS: &str = "expseg's part runs in made() or gone(), which catch (contained); the rest is the driver's call";

/// Why the ordering hooks (src/hooks/order.rs) need no boundary of their own.
const ORDER: &str = "expseg's part runs in synchronized(), recording() or shared_event(), which catch (around_real); the rest is the driver's call";

/// The source without comments and with string and character literals emptied (their braces
/// and words are not code).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A character literal ('{', '\n'); a lifetime ('a) has no closing quote there.
            b'\'' if b.get(i + 2) == Some(&b'\'') => {
                i += 3;
                out.push_str("' '");
            }
            b'\'' if b.get(i + 1) == Some(&b'\\') && b.get(i + 3) == Some(&b'\'') => {
                i += 4;
                out.push_str("' '");
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// Every `extern "C" fn NAME(...) { body }` of `code`: the name and the body. Function types
/// (`extern "C" fn(`) have no name and are not definitions.
fn definitions(code: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let key = "extern \"\" fn ";
    // Literals are emptied: `extern "C"` reads `extern ""` here.
    let mut from = 0;
    while let Some(at) = code[from..].find(key) {
        let start = from + at + key.len();
        from = start;
        let name: String = code[start..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        // The body: from the first `{` after the signature (a `;` first: a declaration).
        let rest = &code[start..];
        let Some(open) = rest.find(['{', ';']) else {
            continue;
        };
        if rest.as_bytes()[open] == b';' {
            continue;
        }
        let mut depth = 0;
        let mut end = open;
        for (k, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k;
                        break;
                    }
                }
                _ => {}
            }
        }
        found.push((name, rest[open..=end].to_string()));
    }
    found
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            // The programs are crates of their own, not loaded into anyone's process.
            if path.file_name().is_some_and(|n| n != "bin") {
                sources(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_extern_c_function_runs_inside_a_panic_boundary() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut all = Vec::new();
    let mut missing = Vec::new();
    for file in files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        for (name, body) in definitions(&code) {
            let exempt = EXEMPT.iter().any(|(f, n, _)| *f == rel && *n == name);
            if !exempt && !MARKERS.iter().any(|m| body.contains(m)) {
                missing.push(format!("{rel}: {name}"));
            }
            all.push((rel.clone(), name));
        }
    }
    assert!(
        missing.is_empty(),
        "extern \"C\" functions without a panic boundary (catch_unwind, or a hook boundary of hooks/guard.rs), or a reason in EXEMPT:\n  {}",
        missing.join("\n  ")
    );
    for (file, name, why) in EXEMPT {
        assert!(
            all.iter().any(|(f, n)| f == file && n == name),
            "EXEMPT names {file}: {name} ({why}), which is gone"
        );
    }
    // There are sixty: a scan that finds few has stopped reading the code.
    assert!(
        all.len() >= 50,
        "only {} extern \"C\" functions found",
        all.len()
    );
}

#[test]
fn the_scan_sees_definitions_and_bodies_but_not_types_or_literals() {
    let code = code_only(
        r#"
        type F = unsafe extern "C" fn(i32) -> i32;
        extern "C" { fn declared(x: i32); }
        pub unsafe extern "C" fn hook(p: *mut u8) -> i32 {
            let s = "catch_unwind( } {"; // catch_unwind(
            boundary("hook", || { if true { 1 } else { '{' as i32 } })
        }
        extern "C" fn bare() { work(); }
        "#,
    );
    let defs = definitions(&code);
    let names: Vec<&str> = defs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["hook", "bare"]);
    assert!(defs[0].1.contains("boundary(") && !defs[0].1.contains("catch_unwind("));
    assert!(defs[0].1.ends_with('}') && defs[1].1.contains("work()"));
}

/// The names of the public `extern "C"` functions `code` defines (`code_only`'s output).
fn public_names(code: &str) -> Vec<String> {
    definitions(code)
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| {
            ["pub extern \"\" fn ", "pub unsafe extern \"\" fn "]
                .iter()
                .any(|key| code.contains(&format!("{key}{name}(")))
        })
        .collect()
}

#[test]
fn every_public_c_function_has_a_row_in_the_contract() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/contract.md")).unwrap();
    let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with("| ")).collect();
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    let mut names = Vec::new();
    for file in files {
        names.extend(public_names(&code_only(
            &std::fs::read_to_string(&file).unwrap(),
        )));
    }
    names.sort();
    names.dedup();
    // A row names a call as `cudaFree(p)`, `cuMemMap` or a C signature, `char *expseg_version(void)`.
    let named = |row: &str, name: &str| {
        row.match_indices(name).any(|(at, _)| {
            let before = row[..at].chars().next_back();
            let after = row[at + name.len()..].chars().next();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
                && matches!(after, Some('(' | '`' | ',' | ' '))
        })
    };
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !rows.iter().any(|r| named(r, n)))
        .collect();
    assert!(
        missing.is_empty(),
        "public extern \"C\" functions without a row in docs/contract.md: {missing:?}"
    );
    assert!(
        names.len() >= 40,
        "only {} public functions found",
        names.len()
    );
}
