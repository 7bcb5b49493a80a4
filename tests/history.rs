//! Comments in src/, docs/contract.md and docs/design.md say what holds now: no dates, commit
//! hashes or work-log references (sessions, issue numbers) in them. Measurements and history
//! live in shim-tests/RESULTS.md and docs/failed-approaches.md, where they may point.

use std::path::Path;

/// What in a comment's text looks like history: a date, a commit hash, a session or issue.
fn history(comment: &str) -> Option<String> {
    let lower = comment.to_lowercase();
    for w in ["session ", "issue ", "issue#", "work log", "work-log"] {
        if let Some(i) = lower.find(w) {
            let after = lower[i + w.len()..].trim_start_matches('#');
            if w.starts_with("work") || after.starts_with(|c: char| c.is_ascii_digit()) {
                return Some(format!("{w:?}"));
            }
        }
    }
    let words = comment.split(|c: char| !c.is_ascii_alphanumeric() && c != '-');
    for w in words {
        let b = w.as_bytes();
        let date = b.len() == 10
            && b[4] == b'-'
            && b[7] == b'-'
            && w.chars().filter(|c| c.is_ascii_digit()).count() == 8;
        let hexish = (7..=40).contains(&w.len())
            && w.chars().all(|c| c.is_ascii_hexdigit())
            && w.chars().any(|c| c.is_ascii_digit())
            && w.chars().any(|c| c.is_ascii_lowercase());
        if date || hexish {
            return Some(w.to_string());
        }
    }
    None
}

/// The comment of a source line (after `//`), outside string literals.
fn comment_of(line: &str) -> Option<&str> {
    let mut in_str = false;
    let b = line.as_bytes();
    let mut i = 0;
    while i + 1 < b.len() {
        match b[i] {
            b'\\' if in_str => i += 1,
            b'"' => in_str = !in_str,
            b'/' if !in_str && b[i + 1] == b'/' => return Some(&line[i + 2..]),
            _ => {}
        }
        i += 1;
    }
    None
}

fn walk(dir: &Path, out: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            for (n, line) in text.lines().enumerate() {
                if let Some(what) = comment_of(line).and_then(history) {
                    out.push(format!(
                        "{}:{}: {what}: {}",
                        p.display(),
                        n + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
}

#[test]
fn comments_in_src_state_what_holds_not_its_history() {
    let mut found = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut found,
    );
    assert!(
        found.is_empty(),
        "{} comments tell history:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// The lines of a document under docs/ that tell history, as `name:line: what`.
fn doc_history(name: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docs")
        .join(name);
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .enumerate()
        .filter_map(|(n, l)| history(l).map(|w| format!("{name}:{}: {w}", n + 1)))
        .collect()
}

#[test]
fn the_contract_states_what_holds_not_its_history() {
    let found = doc_history("contract.md");
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_design_states_what_holds_not_its_history() {
    let found = doc_history("design.md");
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_history_check_sees_what_it_must() {
    assert!(history(" measured on 2026-11-29").is_some());
    assert!(history(" undone at c904993").is_some());
    assert!(history(" (issue 21)").is_some());
    assert!(history(" session 10's runs").is_some());
    assert!(history(" a 2 MiB page, 0x200000").is_none());
    assert!(history(" the decade sets a facade").is_none());
    assert_eq!(comment_of(r#"let s = "a // b"; // c"#), Some(" c"));
}

/// Every source file (tests aside: `tests.rs`, `*_tests.rs`, files under a `tests/` folder,
/// which the map names by folder) has its line in design.md's file map, and every file the map
/// names exists.
#[test]
fn the_design_maps_every_source_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let design = std::fs::read_to_string(root.join("docs/design.md")).unwrap();
    let mut files = Vec::new();
    fn rs(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rs(&p, base, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p.strip_prefix(base).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let src = root.join("src");
    rs(&src, &src, &mut files);
    let missing: Vec<&String> = files
        .iter()
        .filter(|f| !(f.ends_with("tests.rs") || f.contains("/tests/")))
        .filter(|f| !design.contains(&format!("      {f} — ")))
        .collect();
    assert!(missing.is_empty(), "design.md's file map lacks {missing:?}");
    let named: Vec<&str> = design
        .lines()
        .filter_map(|l| l.strip_prefix("      ")?.split_once(" — ").map(|(f, _)| f))
        .filter(|f| f.ends_with(".rs"))
        .collect();
    let gone: Vec<&&str> = named.iter().filter(|f| !src.join(f).exists()).collect();
    assert!(
        gone.is_empty(),
        "design.md's file map names files that are gone: {gone:?}"
    );
}
