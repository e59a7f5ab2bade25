//! What the state-store load consists of: the operation mix (`--mix set=50,get=50`), which key each
//! request touches (`--keys`, `--distribution uniform|zipf`), and the request each operation sends.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use rand::Rng;

/// Largest keyspace `--distribution zipf` accepts: its CDF table takes 8 bytes per key.
pub const MAX_ZIPF_KEYS: u64 = 10_000_000;
/// Zipf exponent: 0.99 is the YCSB default skew.
pub const ZIPF_EXPONENT: f64 = 0.99;

/// One kind of request in the mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Set,
    Get,
    Del,
    VDel,
    SetNx,
    /// `KEYNOTIFY key`: registers this connection for the key, so SETs by every connection fan out
    /// notifications to it (counted as `notification` in the report).
    KeyNotify,
}

impl Op {
    pub const ALL: [Op; 6] = [
        Op::Set,
        Op::Get,
        Op::Del,
        Op::VDel,
        Op::SetNx,
        Op::KeyNotify,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Set => "set",
            Op::Get => "get",
            Op::Del => "del",
            Op::VDel => "vdel",
            Op::SetNx => "setnx",
            Op::KeyNotify => "keynotify",
        }
    }

    /// The request arguments for this operation on `key`, with `value` as the value where one is needed.
    pub fn request(self, key: &Bytes, value: &Bytes) -> Vec<Bytes> {
        let word = |w: &'static str| Bytes::from_static(w.as_bytes());
        match self {
            Op::Set => vec![word("SET"), key.clone(), value.clone()],
            Op::Get => vec![word("GET"), key.clone()],
            Op::Del => vec![word("DEL"), key.clone()],
            Op::VDel => vec![word("VDEL"), key.clone(), value.clone()],
            Op::SetNx => vec![word("SET"), key.clone(), value.clone(), word("NX")],
            Op::KeyNotify => vec![word("KEYNOTIFY"), key.clone()],
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A weighted choice of operations.
#[derive(Debug, Clone, PartialEq)]
pub struct Mix {
    /// (operation, cumulative weight), cumulative weights strictly increasing.
    cumulative: Vec<(Op, u64)>,
}

impl FromStr for Mix {
    type Err = String;

    /// `set=50,get=50`: operation names with non-negative integer weights, at least one positive.
    fn from_str(text: &str) -> Result<Mix, String> {
        let mut cumulative = Vec::new();
        let mut total = 0u64;
        let mut seen = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, weight) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected OP=WEIGHT, e.g. set=50"))?;
            let op = Op::ALL
                .into_iter()
                .find(|op| op.name().eq_ignore_ascii_case(name.trim()))
                .ok_or_else(|| {
                    let names: Vec<&str> = Op::ALL.iter().map(|o| o.name()).collect();
                    format!(
                        "unknown operation {name:?}; use one of {}",
                        names.join(", ")
                    )
                })?;
            if seen.contains(&op) {
                return Err(format!("{op} appears twice"));
            }
            seen.push(op);
            let weight: u64 = weight
                .trim()
                .parse()
                .map_err(|_| format!("{part:?}: the weight must be a whole number"))?;
            if weight > 0 {
                total = total
                    .checked_add(weight)
                    .ok_or_else(|| "weights add up to more than 2^64".to_owned())?;
                cumulative.push((op, total));
            }
        }
        if cumulative.is_empty() {
            return Err("no operation has a positive weight".into());
        }
        Ok(Mix { cumulative })
    }
}

impl Mix {
    fn total(&self) -> u64 {
        self.cumulative.last().map_or(0, |&(_, t)| t)
    }

    /// The operation whose weight interval contains `roll` (in `0..total`).
    fn pick_at(&self, roll: u64) -> Op {
        debug_assert!(roll < self.total());
        let at = self.cumulative.partition_point(|&(_, upto)| upto <= roll);
        self.cumulative[at.min(self.cumulative.len() - 1)].0
    }

    pub fn pick(&self, rng: &mut impl Rng) -> Op {
        self.pick_at(rng.gen_range(0..self.total()))
    }

    pub fn contains(&self, op: Op) -> bool {
        self.cumulative.iter().any(|&(o, _)| o == op)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Distribution {
    Uniform,
    Zipf,
    /// Every key once, in order, then again: loads a keyspace of exactly `--keys` keys.
    Sequential,
}

/// Chooses key indices in `0..keys`.
#[derive(Debug)]
pub enum KeyChooser {
    Uniform {
        keys: u64,
    },
    /// Shared by all connections, so together they visit each key once per round.
    Sequential {
        keys: u64,
        next: AtomicU64,
    },
    /// Cumulative probabilities of ranks 0, 1, …; rank 0 is the hottest key.
    Zipf {
        cdf: Vec<f64>,
    },
}

impl KeyChooser {
    pub fn new(distribution: Distribution, keys: u64) -> Result<KeyChooser, String> {
        if keys == 0 {
            return Err("--keys must be at least 1".into());
        }
        match distribution {
            Distribution::Uniform => Ok(KeyChooser::Uniform { keys }),
            Distribution::Sequential => Ok(KeyChooser::Sequential {
                keys,
                next: AtomicU64::new(0),
            }),
            Distribution::Zipf => {
                if keys > MAX_ZIPF_KEYS {
                    return Err(format!(
                        "--distribution zipf supports at most {MAX_ZIPF_KEYS} keys (its table is 8 bytes per key)"
                    ));
                }
                let weights: Vec<f64> = (1..=keys)
                    .map(|rank| 1.0 / (rank as f64).powf(ZIPF_EXPONENT))
                    .collect();
                let sum: f64 = weights.iter().sum();
                let mut acc = 0.0;
                let cdf = weights
                    .iter()
                    .map(|w| {
                        acc += w / sum;
                        acc
                    })
                    .collect();
                Ok(KeyChooser::Zipf { cdf })
            }
        }
    }

    /// The key index for a uniform `roll` in `[0, 1)`.
    fn index_at(&self, roll: f64) -> u64 {
        match self {
            KeyChooser::Uniform { keys } => ((roll * *keys as f64) as u64).min(keys - 1),
            KeyChooser::Sequential { keys, next } => next.fetch_add(1, Ordering::Relaxed) % keys,
            KeyChooser::Zipf { cdf } => {
                let at = cdf.partition_point(|&p| p <= roll);
                at.min(cdf.len() - 1) as u64
            }
        }
    }

    pub fn pick(&self, rng: &mut impl Rng) -> u64 {
        self.index_at(rng.gen::<f64>())
    }
}

/// The key for index `i`: fixed width, so every key has the same size and sorts in index order.
pub fn key_name(i: u64) -> Bytes {
    Bytes::from(format!("bench:{i:010}"))
}

/// A printable value of `size` bytes (printable so a human inspecting the store can read it).
pub fn value_of_size(size: usize, rng: &mut impl Rng) -> Bytes {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    (0..size)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())])
        .collect::<Vec<u8>>()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn mix_parses_and_picks_by_weight() {
        let mix: Mix = "set=50, get=30,del=0,vdel=20".parse().unwrap();
        assert!(!mix.contains(Op::Del));
        assert_eq!(mix.pick_at(0), Op::Set);
        assert_eq!(mix.pick_at(49), Op::Set);
        assert_eq!(mix.pick_at(50), Op::Get);
        assert_eq!(mix.pick_at(79), Op::Get);
        assert_eq!(mix.pick_at(80), Op::VDel);
        assert_eq!(mix.pick_at(99), Op::VDel);
    }

    #[test]
    fn mix_errors_name_the_problem() {
        assert!("set".parse::<Mix>().unwrap_err().contains("OP=WEIGHT"));
        assert!("put=1".parse::<Mix>().unwrap_err().contains("keynotify"));
        assert!("set=1,set=2".parse::<Mix>().unwrap_err().contains("twice"));
        assert!("set=0".parse::<Mix>().unwrap_err().contains("positive"));
        assert!("set=x".parse::<Mix>().unwrap_err().contains("whole number"));
    }

    #[test]
    fn requests_match_the_spec_commands() {
        let (k, v) = (Bytes::from_static(b"k"), Bytes::from_static(b"v"));
        assert_eq!(
            mqstate_protocol::encode_request(&Op::SetNx.request(&k, &v)),
            Bytes::from_static(b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nNX\r\n")
        );
        assert_eq!(
            mqstate_protocol::encode_request(&Op::Get.request(&k, &v)),
            Bytes::from_static(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")
        );
        for op in Op::ALL {
            let args = op.request(&k, &v);
            assert!(mqstate_protocol::Command::parse(args).is_ok(), "{op}");
        }
    }

    #[test]
    fn uniform_covers_the_range() {
        let chooser = KeyChooser::new(Distribution::Uniform, 10).unwrap();
        assert_eq!(chooser.index_at(0.0), 0);
        assert_eq!(chooser.index_at(0.999_999), 9);
    }

    #[test]
    fn zipf_prefers_low_ranks_and_stays_in_range() {
        let chooser = KeyChooser::new(Distribution::Zipf, 1000).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut hits = [0u32; 2];
        for _ in 0..10_000 {
            let i = chooser.pick(&mut rng);
            assert!(i < 1000);
            if i == 0 {
                hits[0] += 1;
            } else if i == 999 {
                hits[1] += 1;
            }
        }
        assert!(hits[0] > 50 * (hits[1] + 1), "{hits:?}");
        assert_eq!(chooser.index_at(0.999_999_999), 999);
        assert!(KeyChooser::new(Distribution::Zipf, MAX_ZIPF_KEYS + 1).is_err());
    }

    #[test]
    fn sequential_visits_every_key_once_per_round() {
        let chooser = KeyChooser::new(Distribution::Sequential, 3).unwrap();
        let mut rng = rand::thread_rng();
        let picks: Vec<u64> = (0..7).map(|_| chooser.pick(&mut rng)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
        assert!(KeyChooser::new(Distribution::Uniform, 0).is_err());
    }

    #[test]
    fn keys_and_values_have_fixed_sizes() {
        assert_eq!(key_name(42), Bytes::from_static(b"bench:0000000042"));
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let v = value_of_size(100, &mut rng);
        assert_eq!(v.len(), 100);
        assert!(v.iter().all(u8::is_ascii_alphanumeric));
    }
}
