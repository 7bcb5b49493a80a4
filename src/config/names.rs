//! Names: whether an `EXPSEG_*` variable of the environment is one expseg reads, and else
//! the known name closest to it (a misspelling gets one line naming the likely one).

/// `EXPSEG_*` variables that expseg's tools, launchers, build and tests read, besides the
/// library's table ([`VARS`]): set where the library runs, they are no misspellings.
const TOOL_VARS: &[&str] = &[
    // expseg-run, expseg-srun, expseg doctor (docs/configuration.md)
    "EXPSEG_REPORT_DIR",
    "EXPSEG_LIB",
    "EXPSEG_CUDART",
    // set by the library and expseg-run beside the PyTorch setting they applied
    "EXPSEG_TORCH_DEFAULTS_APPLIED",
    // pip wheel, scripts/build-portable.sh (docs/configuration.md)
    "EXPSEG_PREBUILT",
    "EXPSEG_WHEEL_PLAT",
    "EXPSEG_ARCHES",
    // scripts/expseg.sbatch, scripts/install-launchers.sh
    "EXPSEG_HOME",
    "EXPSEG_LAUNCHERS_HOME",
    // cargo's tests (seeds, the randomized search, socket helpers), scripts/test-launchers.sh
    "EXPSEG_TEST_SEED",
    "EXPSEG_TEST_SOAK",
    "EXPSEG_TEST_POKE",
    "EXPSEG_TEST_SERVE",
    "EXPSEG_TEST_KEEP",
];

/// A variable named `EXPSEG_*` that expseg does not read (a misspelling, or a name of another
/// version), and the known name closest to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unknown {
    pub name: String,
    pub closest: &'static str,
}

impl Unknown {
    /// What is wrong, for `expseg doctor`'s row.
    pub fn message(&self) -> String {
        format!(
            "{} is not an expseg variable (did you mean {}?); ignored",
            self.name, self.closest
        )
    }

    /// The stderr line, in the style of an invalid value's.
    pub fn line(&self) -> String {
        format!("expseg: {}", self.message())
    }
}

/// `config::unknown_vars`, with `library` the names of the library's own table (first on a
/// tie) and the tools' names after them.
pub(super) fn unknown_among<K, V>(
    vars: impl IntoIterator<Item = (K, V)>,
    library: &[&'static str],
) -> Vec<Unknown>
where
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let known = || library.iter().copied().chain(TOOL_VARS.iter().copied());
    let mut out: Vec<Unknown> = vars
        .into_iter()
        .filter_map(|(k, v)| {
            let name = k.as_ref().to_string_lossy();
            let set = !v.as_ref().to_string_lossy().trim().is_empty();
            (set && name.starts_with("EXPSEG_") && !known().any(|n| n == name)).then(|| {
                let upper = name.to_ascii_uppercase();
                let closest = known()
                    .min_by_key(|n| edit_distance(upper.as_bytes(), n.as_bytes()))
                    .unwrap_or("EXPSEG_DISABLE");
                Unknown {
                    name: name.into_owned(),
                    closest,
                }
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Edits (insert, delete, replace, swap two neighbours) that turn `a` into `b`.
pub(super) fn edit_distance(a: &[u8], b: &[u8]) -> usize {
    // Three rows of the optimal string alignment table.
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut row = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        row[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            row[j] = (prev[j] + 1).min(row[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                row[j] = row[j].min(before[j - 2] + 1);
            }
        }
        std::mem::swap(&mut before, &mut prev);
        std::mem::swap(&mut prev, &mut row);
    }
    prev[b.len()]
}
