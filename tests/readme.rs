//! The README stays a user's page: at most 1,500 words, and none of them a commit hash, a
//! numbered session of work or an issue number (those live in shim-tests/RESULTS.md).

#[test]
fn the_readme_is_short_and_free_of_the_projects_history() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let words = text.split_whitespace().count();
    assert!(words <= 1500, "README.md has {words} words (at most 1,500)");
    for w in text.split(|c: char| !c.is_ascii_alphanumeric()) {
        let hexish = w.len() >= 7
            && w.chars().all(|c| c.is_ascii_hexdigit())
            && w.chars().any(|c| c.is_ascii_digit())
            && w.chars().any(|c| c.is_ascii_alphabetic());
        assert!(!hexish, "README.md names what looks like a commit: {w}");
    }
    let lower = text.to_lowercase();
    for history in ["session ", "issue #", "round of work"] {
        assert!(!lower.contains(history), "README.md mentions {history:?}");
    }
}
