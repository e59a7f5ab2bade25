//! The ids the broker assigns to clients that connect with an empty client id.
//!
//! They come from a seedable generator handed to the broker ([`crate::BrokerBuilder::client_ids`]),
//! so that a simulation run from a seed assigns the same ids every time; production seeds it from
//! the operating system's entropy.

use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// Prefix of identifiers assigned to clients that connect with an empty one.
pub(crate) const ASSIGNED_ID_PREFIX: &str = "mqs-";

/// A source of assigned client ids: the prefix and 16 hex digits of a random 64-bit number.
#[derive(Debug)]
pub struct ClientIds {
    rng: Mutex<StdRng>,
}

impl ClientIds {
    /// Ids from the operating system's entropy: what production uses.
    pub fn random() -> Self {
        Self::with(StdRng::from_entropy())
    }

    /// The same sequence of ids for the same seed.
    pub fn seeded(seed: u64) -> Self {
        Self::with(StdRng::seed_from_u64(seed))
    }

    fn with(rng: StdRng) -> Self {
        ClientIds {
            rng: Mutex::new(rng),
        }
    }

    /// The next id.
    pub(crate) fn next(&self) -> Arc<str> {
        // A poisoned lock still holds a usable generator.
        let n = self
            .rng
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .next_u64();
        format!("{ASSIGNED_ID_PREFIX}{n:016x}").into()
    }
}

impl Default for ClientIds {
    fn default() -> Self {
        Self::random()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_ids_and_ids_differ() {
        let (a, b) = (ClientIds::seeded(7), ClientIds::seeded(7));
        let ids: Vec<_> = (0..3).map(|_| a.next()).collect();
        assert_eq!(ids, (0..3).map(|_| b.next()).collect::<Vec<_>>());
        assert_ne!(ids[0], ids[1]);
        assert!(
            ids[0].starts_with(ASSIGNED_ID_PREFIX) && ids[0].len() == ASSIGNED_ID_PREFIX.len() + 16
        );
        assert_ne!(ClientIds::seeded(8).next(), ids[0]);
    }
}
