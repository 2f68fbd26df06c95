//! A small coverage-free mutator: byte flips, interesting values, block copies and splices
//! between corpus entries, in the spirit of libFuzzer's and AFL's havoc stage.

/// xorshift64*: fast and reproducible from `--seed`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: [u64; 14] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    u64::MAX,
];

/// Mutates `data` in place by 1 to 8 stacked operations, keeping it at most `max_len`
/// bytes; `other` is another corpus entry for splicing.
pub fn mutate(rng: &mut Rng, data: &mut Vec<u8>, other: &[u8], max_len: usize) {
    let rounds = 1 + rng.below(8);
    for _ in 0..rounds {
        match rng.below(10) {
            0 if !data.is_empty() => {
                let i = rng.below(data.len());
                data[i] ^= 1 << rng.below(8);
            }
            1 if !data.is_empty() => {
                let i = rng.below(data.len());
                data[i] = rng.next() as u8;
            }
            2 if !data.is_empty() => {
                // An interesting value, 1, 2, 4 or 8 bytes wide, little- or big-endian.
                let width = 1 << rng.below(4);
                let value = INTERESTING[rng.below(INTERESTING.len())];
                let bytes = if rng.below(2) == 0 {
                    value.to_le_bytes()
                } else {
                    value.to_be_bytes()
                };
                let at = rng.below(data.len());
                let n = width.min(data.len() - at);
                let from = if rng.below(2) == 0 { 0 } else { 8 - width };
                data[at..at + n].copy_from_slice(&bytes[from..from + n]);
            }
            3 if !data.is_empty() => {
                // Add or subtract a small number from a byte.
                let i = rng.below(data.len());
                let delta = 1 + rng.below(16) as u8;
                data[i] = if rng.below(2) == 0 {
                    data[i].wrapping_add(delta)
                } else {
                    data[i].wrapping_sub(delta)
                };
            }
            4 if data.len() > 1 => {
                // Delete a block.
                let at = rng.below(data.len());
                let n = 1 + rng.below((data.len() - at).min(64));
                data.drain(at..at + n);
            }
            5 if data.len() < max_len => {
                // Insert random bytes.
                let at = rng.below(data.len() + 1);
                let n = (1 + rng.below(32)).min(max_len - data.len());
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                data.splice(at..at, bytes);
            }
            6 if !data.is_empty() => {
                // Copy a block within the input.
                let from = rng.below(data.len());
                let n = 1 + rng.below((data.len() - from).min(64));
                let to = rng.below(data.len());
                let n = n.min(data.len() - to);
                let block = data[from..from + n].to_vec();
                data[to..to + n].copy_from_slice(&block);
            }
            7 if !other.is_empty() => {
                // Splice: our head, the other's tail.
                let cut = rng.below(data.len() + 1);
                let from = rng.below(other.len());
                data.truncate(cut);
                data.extend_from_slice(&other[from..]);
            }
            8 if !other.is_empty() && !data.is_empty() => {
                // Overwrite a block with one of the other input.
                let from = rng.below(other.len());
                let n = 1 + rng.below((other.len() - from).min(64));
                let to = rng.below(data.len());
                let n = n.min(data.len() - to);
                data[to..to + n].copy_from_slice(&other[from..from + n]);
            }
            _ => {
                // Truncate, now and then, to find short-input paths.
                if rng.below(4) == 0 && !data.is_empty() {
                    let len = rng.below(data.len());
                    data.truncate(len);
                }
            }
        }
    }
    data.truncate(max_len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutation_stays_within_max_len_and_changes_input() {
        let mut rng = Rng::new(7);
        let seed = vec![0u8; 100];
        let mut changed = 0;
        for _ in 0..1000 {
            let mut data = seed.clone();
            mutate(&mut rng, &mut data, b"other input", 128);
            assert!(data.len() <= 128);
            if data != seed {
                changed += 1;
            }
        }
        assert!(
            changed > 900,
            "only {changed} of 1000 mutations changed the input"
        );
    }
}
