//! Test builds only: the randomized tests' generator (xorshift64*), seeded from
//! `EXPSEG_TEST_SEED` or the clock, the seed printed for replay.

pub(crate) struct Rng(u64);

impl Rng {
    /// Seeded from `EXPSEG_TEST_SEED`, else the clock; `what` names the test in the line that
    /// prints the seed.
    pub(crate) fn from_env(what: &str) -> Self {
        let seed = std::env::var("EXPSEG_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("{what} seed: EXPSEG_TEST_SEED={seed}");
        Rng(seed)
    }

    pub(crate) fn seed(&self) -> u64 {
        self.0
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
