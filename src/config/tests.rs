//! Tests of the `EXPSEG_*` table: defaults, parsing, invalid values, the test switches.

use super::names::edit_distance;
use super::*;
use std::collections::HashMap;

fn with(vars: &[(&str, &str)]) -> (Config, Vec<String>) {
    let m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut bad = Vec::new();
    let c = Config::from_lookup(|n| m.get(n).cloned().map(Ok), |l| bad.push(l));
    (c, bad)
}

#[test]
fn defaults_when_nothing_is_set() {
    assert_eq!(with(&[]), (Config::default(), vec![]));
}

#[test]
fn sizes_take_suffixes() {
    assert_eq!(parse_size("0"), Ok(0));
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("512M"), Ok(512 * MIB));
    assert_eq!(parse_size("2GiB"), Ok(2 * GIB));
    assert_eq!(parse_size(" 3 g "), Ok(3 * GIB));
    assert!(parse_size("lots").is_err());
    assert!(parse_size("-1").is_err());
    assert!(parse_size("99999999999T").is_err());
    assert_eq!(fmt_size(GIB), "1G");
    assert_eq!(fmt_size(3 * MIB / 2), "1536K");
}

#[test]
fn each_variable_reaches_its_field() {
    let (c, bad) = with(&[
        ("EXPSEG_DISABLE", "yes"),
        ("EXPSEG_LOG", "expseg=debug,info"),
        ("EXPSEG_PASSTHROUGH_BELOW", "0"),
        ("EXPSEG_CACHE_MAX", "16G"),
        ("EXPSEG_REPORT", "/tmp/r-%p.txt"),
        ("EXPSEG_DRIVER_API", "0"),
    ]);
    assert!(bad.is_empty(), "{bad:?}");
    assert!(c.disabled);
    assert!(!c.driver_api);
    assert_eq!(c.log, "expseg=debug,info");
    assert_eq!(c.passthrough_below, 0);
    assert_eq!(c.cache_max, 16 * GIB);
    assert_eq!(c.report.as_deref(), Some("/tmp/r-%p.txt"));
    let (c, bad) = with(&[("EXPSEG_REPORT", "none")]);
    assert!(
        bad.is_empty() && c.report.is_none(),
        "none is off, as for expseg-run"
    );
}

#[test]
fn two_word_variables_take_either_word_or_nothing() {
    assert!(Config::default().ipc_extent_torch && !Config::default().ipc_peers_expseg);
    let (c, bad) = with(&[("EXPSEG_IPC_EXTENT", "run"), ("EXPSEG_IPC_PEERS", "expseg")]);
    assert!(bad.is_empty() && !c.ipc_extent_torch && c.ipc_peers_expseg);
    let (c, bad) = with(&[("EXPSEG_IPC_EXTENT", " "), ("EXPSEG_IPC_PEERS", "")]);
    assert!(bad.is_empty() && c.ipc_extent_torch && !c.ipc_peers_expseg);
    let (c, bad) = with(&[("EXPSEG_IPC_EXTENT", "all")]);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(c.ipc_extent_torch, "the default kept");
}

#[test]
fn switches_take_only_their_words_and_anything_else_keeps_the_default() {
    type Field = fn(&Config) -> bool;
    let switches: [(&str, Field); 6] = [
        ("EXPSEG_DISABLE", |c| c.disabled),
        ("EXPSEG_DRIVER_API", |c| c.driver_api),
        ("EXPSEG_TORCH_DEFAULTS", |c| c.torch_defaults),
        ("EXPSEG_MOVE_FENCE", |c| c.move_fence),
        ("EXPSEG_IPC_TICKETS", |c| c.ipc_tickets),
        ("EXPSEG_CONTROL", |c| c.control),
    ];
    for (name, field) in switches {
        let default = field(&Config::default());
        for (word, want) in [
            ("1", true),
            ("true", true),
            ("YES", true),
            (" on ", true),
            ("0", false),
            ("false", false),
            ("no", false),
            ("Off", false),
        ] {
            let (c, bad) = with(&[(name, word)]);
            assert!(
                bad.is_empty() && field(&c) == want,
                "{name}={word:?}: {bad:?}"
            );
        }
        // Unset and empty are the same: the default, silently.
        let (c, bad) = with(&[(name, " ")]);
        assert!(
            bad.is_empty() && field(&c) == default,
            "{name}=\" \": {bad:?}"
        );
        for word in ["2", "-1", "enabled", "y", "disable"] {
            let (c, bad) = with(&[(name, word)]);
            assert_eq!(field(&c), default, "{name}={word:?}: the default is used");
            assert_eq!(bad.len(), 1, "{name}={word:?}: one line");
            assert!(
                bad[0].contains(&format!("{name}=\"{word}\""))
                    && bad[0].contains("1/0, true/false, yes/no or on/off"),
                "{}",
                bad[0]
            );
        }
    }
}

#[test]
fn the_peer_hold_takes_a_switch_or_self() {
    assert_eq!(Config::default().peer_hold, PeerHold::Off);
    for (v, want) in [
        ("1", PeerHold::On),
        ("on", PeerHold::On),
        ("0", PeerHold::Off),
        (" self ", PeerHold::SelfTest),
    ] {
        let (c, bad) = with(&[("EXPSEG_PEER_HOLD", v)]);
        assert!(bad.is_empty() && c.peer_hold == want, "{v}: {bad:?}");
    }
    let (c, bad) = with(&[("EXPSEG_PEER_HOLD", "peers")]);
    assert_eq!(c.peer_hold, PeerHold::Off);
    assert!(bad.len() == 1 && bad[0].contains("EXPSEG_PEER_HOLD") && bad[0].contains("self"));
}

#[test]
fn a_bad_value_gives_one_line_naming_it_and_the_default() {
    let (c, bad) = with(&[("EXPSEG_CACHE_MAX", "lots"), ("EXPSEG_LOG", "loud!")]);
    assert_eq!(c, Config::default());
    assert_eq!(bad.len(), 2);
    assert!(
        bad[0].contains("EXPSEG_LOG") && bad[0].contains("\"loud!\"") && bad[0].contains("warn")
    );
    assert!(
        bad[1].contains("EXPSEG_CACHE_MAX")
            && bad[1].contains("\"lots\"")
            && bad[1].contains("default 0")
    );
    assert!(bad.iter().all(|l| !l.contains('\n')));
}

#[test]
fn log_words_that_would_silence_expseg_are_refused() {
    for word in ["loud", "warning", "verbose", "torch=debug"] {
        let (c, bad) = with(&[("EXPSEG_LOG", word)]);
        assert_eq!(c.log, "warn", "{word}");
        assert_eq!(bad.len(), 1, "{word}: {bad:?}");
    }
    for ok in ["debug", "expseg=debug", "info,expseg::api=trace", "off"] {
        assert!(with(&[("EXPSEG_LOG", ok)]).1.is_empty(), "{ok}");
    }
}

#[test]
fn a_value_that_is_not_utf8_gets_its_line() {
    let mut bad = Vec::new();
    let c = Config::from_lookup(
        |n| (n == "EXPSEG_CACHE_MAX").then(|| Err("1\u{FFFD}G".to_string())),
        |l| bad.push(l),
    );
    assert_eq!(c.cache_max, 0);
    assert_eq!(bad.len(), 1);
    assert!(bad[0].contains("EXPSEG_CACHE_MAX") && bad[0].contains("not UTF-8"));
}

#[test]
fn test_switches_are_read_only_in_builds_with_the_feature() {
    let set = [
        ("EXPSEG_TEST_PANIC", "cudaMalloc"),
        ("EXPSEG_TEST_SLOW_CHECK", "1500"),
        ("EXPSEG_TEST_SLOW_EXPORT", "300"),
        ("EXPSEG_TEST_FAIL_MOVE", "copy"),
        ("EXPSEG_TEST_TRACE", "/tmp/t"),
        ("EXPSEG_TEST_HOST_AVAILABLE", "/tmp/h"),
    ];
    let (c, bad) = with(&set);
    if TEST_SWITCHES {
        assert!(bad.is_empty(), "{bad:?}");
        assert!(c.test_panic("cudaMalloc"));
        assert_eq!(c.test_slow_check_ms, Some(1500));
        assert_eq!(c.test_slow_export_ms, Some(300));
        assert_eq!(c.test_fail_move.as_deref(), Some("copy"));
        assert_eq!(c.test_trace.as_deref(), Some("/tmp/t"));
        assert_eq!(c.test_host_available.as_deref(), Some("/tmp/h"));
    } else {
        assert_eq!(c, Config::default(), "a release build ignores them");
        assert_eq!(bad.len(), set.len(), "one line each: {bad:?}");
        for ((name, _), line) in set.iter().zip(&bad) {
            assert!(
                line.contains(name) && line.contains("test-switches"),
                "{line}"
            );
        }
        // Set but empty: nothing to say.
        assert!(with(&[("EXPSEG_TEST_PANIC", "")]).1.is_empty());
    }
}

#[test]
fn a_test_panic_with_a_count_fires_at_that_call_only() {
    let c = Config {
        test_panic: Some("pool:2".into()),
        ..Config::default()
    };
    assert!(!c.test_panic("cudaMalloc"));
    let calls: Vec<bool> = (0..4).map(|_| c.test_panic("pool")).collect();
    assert_eq!(calls, [false, true, false, false]);
    let every = Config {
        test_panic: Some("cudaFree".into()),
        ..Config::default()
    };
    assert!(every.test_panic("cudaFree") && every.test_panic("cudaFree"));
}

#[test]
fn the_ipc_directory_must_exist_and_be_absolute() {
    for v in ["", "relative/dir", "/nonexistent/expseg/dir"] {
        let (c, bad) = with(&[("EXPSEG_IPC_DIR", v)]);
        assert_eq!(c.ipc_dir, "/tmp", "{v:?}");
        assert_eq!(bad.len(), 1, "{v:?}");
    }
    assert!(with(&[("EXPSEG_IPC_DIR", "/tmp")]).1.is_empty());
    // Writable by others without the sticky bit: anyone could take or remove what is made
    // there. Sticky (as /tmp) or private: taken.
    use std::os::unix::fs::PermissionsExt;
    let d = std::env::temp_dir().join(format!("expseg-ipcbase-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let v = d.to_str().unwrap();
    for (mode, ok) in [
        (0o777, false),
        (0o775, false),
        (0o1777, true),
        (0o755, true),
    ] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).unwrap();
        let (c, bad) = with(&[("EXPSEG_IPC_DIR", v)]);
        assert_eq!(bad.is_empty(), ok, "{mode:o}: {bad:?}");
        assert_eq!(c.ipc_dir == v, ok, "{mode:o}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn learned_placement_is_on_by_default_and_a_switch() {
    assert!(Config::default().learn_cuts);
    let (c, bad) = with(&[("EXPSEG_LEARN_CUTS", "off")]);
    assert!(bad.is_empty() && !c.learn_cuts);
    let (c, bad) = with(&[("EXPSEG_LEARN_CUTS", "sometimes")]);
    assert!(c.learn_cuts);
    assert!(
        bad.len() == 1 && bad[0].contains("EXPSEG_LEARN_CUTS"),
        "{bad:?}"
    );
}

#[test]
fn host_buffers_are_kept_while_the_host_has_room_unless_told_otherwise() {
    use crate::config::KeepHost;
    assert_eq!(Config::default().pause_keep_host, KeepHost::Auto);
    for (word, want) in [
        ("0", KeepHost::Off),
        ("off", KeepHost::Off),
        ("1", KeepHost::On),
        ("yes", KeepHost::On),
        ("auto", KeepHost::Auto),
        (" AUTO ", KeepHost::Auto),
        ("", KeepHost::Auto),
    ] {
        let (c, bad) = with(&[("EXPSEG_PAUSE_KEEP_HOST", word)]);
        assert!(bad.is_empty(), "{word:?}: {bad:?}");
        assert_eq!(c.pause_keep_host, want, "{word:?}");
    }
    let (c, bad) = with(&[("EXPSEG_PAUSE_KEEP_HOST", "sometimes")]);
    assert_eq!(bad.len(), 1);
    assert!(bad[0].contains("auto"), "{bad:?}");
    assert_eq!(c.pause_keep_host, KeepHost::Auto);
}

#[test]
fn every_variable_but_the_test_switches_is_in_docs_configuration_md() {
    let doc = include_str!("../../docs/configuration.md");
    let missing: Vec<&str> = VARS
        .iter()
        .map(|v| v.name)
        .filter(|n| !n.starts_with(TEST_SWITCH) && !doc.contains(&format!("`{n}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md: {missing:?}"
    );
    assert!(VARS.len() >= 30);
}

#[test]
fn an_unknown_expseg_variable_is_named_with_the_closest_known_one() {
    let env = [
        ("EXPSEG_DISABEL", "1"),
        ("EXPSEG_CACHE_MAX", "1G"),
        ("EXPSEG_cache_max", "1G"),
        ("EXPSEG_COALESCE_MARGN", "2G"),
        ("EXPSEG_REPORTDIR", "/tmp/r"),
        ("EXPSEG_TEST_PANICK", "cudaMalloc"),
        ("PATH", "/usr/bin"),
        ("MY_EXPSEG_DISABEL", "1"),
        // Set but empty: as if unset, nothing to say.
        ("EXPSEG_UNUSED", " "),
    ];
    let found = unknown_vars(env);
    let pairs: Vec<(&str, &str)> = found.iter().map(|u| (u.name.as_str(), u.closest)).collect();
    assert_eq!(
        pairs,
        [
            ("EXPSEG_COALESCE_MARGN", "EXPSEG_COALESCE_MARGIN"),
            ("EXPSEG_DISABEL", "EXPSEG_DISABLE"),
            ("EXPSEG_REPORTDIR", "EXPSEG_REPORT_DIR"),
            ("EXPSEG_TEST_PANICK", "EXPSEG_TEST_PANIC"),
            ("EXPSEG_cache_max", "EXPSEG_CACHE_MAX"),
        ]
    );
    // One line each, in the style of an invalid value's.
    assert_eq!(
        found[1].line(),
        "expseg: EXPSEG_DISABEL is not an expseg variable (did you mean EXPSEG_DISABLE?); ignored"
    );
    assert!(found.iter().all(|u| !u.line().contains('\n')));
}

#[test]
fn every_expseg_variable_that_expseg_or_its_tools_read_is_known() {
    // The table (test switches too, in any build), the tools' and the tests' own.
    let mut names: Vec<&str> = VARS.iter().map(|v| v.name).collect();
    names.extend([
        "EXPSEG_REPORT_DIR",
        "EXPSEG_LIB",
        "EXPSEG_CUDART",
        "EXPSEG_PREBUILT",
        "EXPSEG_WHEEL_PLAT",
        "EXPSEG_ARCHES",
        "EXPSEG_TEST_SEED",
        "EXPSEG_TEST_SOAK",
    ]);
    // Every name docs/configuration.md gives.
    let doc = include_str!("../../docs/configuration.md");
    names.extend(doc.split('`').filter(|w| {
        w.starts_with("EXPSEG_")
            && w.len() > "EXPSEG_".len()
            && w.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
    }));
    let unknown = unknown_vars(names.iter().map(|n| (n, "1")));
    assert!(unknown.is_empty(), "{unknown:?}");
}

#[test]
fn edit_distance_counts_a_swap_as_one() {
    assert_eq!(edit_distance(b"DISABEL", b"DISABLE"), 1);
    assert_eq!(edit_distance(b"", b"LOG"), 3);
    assert_eq!(edit_distance(b"LOG", b"LOG"), 0);
    assert_eq!(edit_distance(b"CACHE_SIZE", b"CACHE_MAX"), 4);
}

#[test]
fn keeping_for_expseg_only_gpus_is_opt_in() {
    let (c, bad) = with(&[]);
    assert!(!c.keep_auto && !c.keeps() && bad.is_empty());
    let (c, _) = with(&[("EXPSEG_KEEP", " Auto ")]);
    assert!(
        c.keep_auto && c.keeps(),
        "a process that keeps serves reclaims"
    );
    let (c, _) = with(&[("EXPSEG_KEEP", "off")]);
    assert!(!c.keep_auto);
    let (c, bad) = with(&[("EXPSEG_KEEP", "always")]);
    assert!(!c.keep_auto);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("EXPSEG_KEEP"), "{bad:?}");
}

#[test]
fn the_bound_on_what_is_kept_is_milliseconds_and_a_bad_word_keeps_the_default() {
    let (c, bad) = with(&[]);
    assert_eq!((c.keep_giveback_ms, bad.len()), (40, 0));
    for (word, want) in [("25", 25), ("25ms", 25), (" 0 ", 0), ("10000", 10_000)] {
        let (c, bad) = with(&[("EXPSEG_KEEP_GIVEBACK", word)]);
        assert_eq!((c.keep_giveback_ms, bad.len()), (want, 0), "{word:?}");
    }
    for word in ["fast", "-1", "10001", "2s"] {
        let (c, bad) = with(&[("EXPSEG_KEEP_GIVEBACK", word)]);
        assert_eq!(c.keep_giveback_ms, 40, "{word:?}");
        assert!(
            bad.len() == 1 && bad[0].contains("EXPSEG_KEEP_GIVEBACK"),
            "{bad:?}"
        );
    }
}
