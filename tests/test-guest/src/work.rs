//! Pure arithmetic of the snapshot commands: the `prng` generator with its reseed mix,
//! and the `compute` loop step. Kept apart from I/O so the host unit tests cover it.

/// The `prng` state before any call (any non-zero value works for xorshift).
pub const PRNG_SEED: u64 = 0x9e37_79b9_7f4a_7c15;
/// Initial state of the `compute` hash and its LCG.
pub const COMPUTE_HASH_INIT: u64 = 0xcbf2_9ce4_8422_2325;
pub const COMPUTE_LCG_INIT: u64 = 0x0123_4567_89ab_cdef;

/// One xorshift64* step: advances `state` and returns the output value.
pub fn xorshift64star(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// splitmix64's finaliser: spreads the bits of a small counter over the whole word.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The state after a generation change: the old state, the new generation and the TSC
/// folded together. Never zero (xorshift would stay at zero forever).
pub fn reseed(state: u64, generation: u64, tsc: u64) -> u64 {
    match state ^ mix(generation) ^ tsc {
        0 => PRNG_SEED,
        s => s,
    }
}

/// The state of one `compute` run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Compute {
    pub hash: u64,
    pub lcg: u64,
}

impl Compute {
    pub const START: Compute = Compute {
        hash: COMPUTE_HASH_INIT,
        lcg: COMPUTE_LCG_INIT,
    };

    /// Iteration `i`: an LCG step (Knuth's MMIX constants) folded into an FNV-style hash.
    pub fn step(self, i: u64) -> Compute {
        let lcg = self
            .lcg
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let hash = (self.hash ^ (lcg >> 29) ^ i).wrapping_mul(0x0000_0100_0000_01b3);
        Compute { hash, lcg }
    }
}

/// The end of progress stage `k` (1..=10) of an `n`-iteration run: `n * k / 10`
/// without overflow.
pub fn stage_end(n: u64, k: u64) -> u64 {
    (n / 10) * k + (n % 10) * k / 10
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xorshift_matches_reference_sequence() {
        // Reference values from the published xorshift64* (Vigna), seed 1.
        let mut s = 1u64;
        let first = xorshift64star(&mut s);
        // 1 ^ (1 << 25); the `>> 27` step changes nothing for so small a value.
        assert_eq!(s, 0x0000_0000_0200_0001);
        assert_eq!(first, s.wrapping_mul(0x2545_f491_4f6c_dd1d));
        // The state advances and does not repeat quickly.
        let mut seen = std::collections::HashSet::new();
        let mut s = PRNG_SEED;
        for _ in 0..1000 {
            assert!(seen.insert(xorshift64star(&mut s)));
        }
    }

    #[test]
    fn reseed_depends_on_generation_and_never_yields_zero() {
        assert_ne!(reseed(5, 1, 0), reseed(5, 2, 0));
        assert_ne!(mix(0), 0);
        let s = 77;
        assert_eq!(reseed(s, 3, s ^ mix(3)), PRNG_SEED);
    }

    #[test]
    fn compute_is_resumable() {
        // Running 0..n at once equals running 0..m, keeping the state, then m..n: what a
        // snapshot taken mid-loop relies on.
        let run = |from: u64, to: u64, c: Compute| (from..to).fold(c, |c, i| c.step(i));
        let whole = run(0, 1000, Compute::START);
        let split = run(400, 1000, run(0, 400, Compute::START));
        assert_eq!(whole, split);
        assert_ne!(whole, run(0, 999, Compute::START));
    }

    #[test]
    fn compute_hashes_match_the_protocol_examples() {
        let hash = |n: u64| (0..n).fold(Compute::START, |c, i| c.step(i)).hash;
        assert_eq!(hash(1000), 0x2ace_5601_c30c_807f);
        assert_eq!(hash(200_000), 0x614b_ae4c_02f6_392d);
    }

    #[test]
    fn stage_ends_split_n_into_tenths() {
        assert_eq!(stage_end(200_000, 1), 20_000);
        assert_eq!(stage_end(200_000, 10), 200_000);
        assert_eq!(stage_end(7, 10), 7);
        assert_eq!(stage_end(7, 5), 3);
        assert_eq!(stage_end(u64::MAX, 10), u64::MAX);
        let ends: Vec<u64> = (1..=10).map(|k| stage_end(13, k)).collect();
        assert!(ends.windows(2).all(|w| w[0] <= w[1]));
    }
}
