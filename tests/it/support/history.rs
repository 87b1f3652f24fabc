//! What the two recorded-history tests (`history.rs`, `history_fence.rs`) share: the seeded
//! generator of their fault schedules, which seeds a run checks, and dropping a seed's
//! database once its history is read.

use super::sql;

/// splitmix64: small, deterministic, good enough for schedules.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

/// The seeds to run: `HISTORY_SEED=n` (that one), `HISTORY_SEEDS=n` (1 to n), else `ci`.
pub fn seeds(ci: &[u64]) -> Vec<u64> {
    if let Some(one) = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![one];
    }
    match std::env::var("HISTORY_SEEDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        Some(n) => (1..=n).collect(),
        None => ci.to_vec(),
    }
}

/// Drops a seed's database once its history is read, so a long soak does not fill the disk.
pub async fn drop_database(db: &str) {
    let Some((base, name)) = db.rsplit_once('/') else {
        return;
    };
    let admin = sql(&format!("{base}/postgres")).await;
    if let Err(e) = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
    {
        println!("could not drop {name}: {e}");
    }
}
