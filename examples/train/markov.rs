//! The main job's task: a generated first-order Markov source whose entropy rate (the lowest loss any
//! next-token predictor can reach) and best accuracy are computed exactly.

use candle_core::{Device, Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const VOCAB: usize = 32;
pub const SUCCESSORS: usize = 3; // likely successors per token

/// A first-order Markov source: each token has `SUCCESSORS` likely successors, plus a little mass on
/// every token so that the chain is irreducible and aperiodic (a unique stationary distribution).
pub struct Markov {
    vocab: usize,
    rows: Vec<Vec<f64>>,
    stationary: Vec<f64>,
}

impl Markov {
    /// The main job's source: `VOCAB` tokens, `SUCCESSORS` likely successors each.
    pub fn generate(seed: u64) -> Self {
        Self::with_size(seed, VOCAB, SUCCESSORS)
    }

    /// A source of `vocab` tokens with `successors` likely successors each (the tests' smaller tasks).
    pub fn with_size(seed: u64, vocab: usize, successors: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let rows: Vec<Vec<f64>> = (0..vocab)
            .map(|_| {
                let mut row = vec![0.002; vocab];
                for _ in 0..successors {
                    row[rng.random_range(0..vocab)] += rng.random_range(0.2..1.0);
                }
                let total: f64 = row.iter().sum();
                row.iter().map(|p| p / total).collect()
            })
            .collect();
        let mut stationary = vec![1.0 / vocab as f64; vocab];
        for _ in 0..10_000 {
            let mut next = vec![0.0; vocab];
            for (i, row) in rows.iter().enumerate() {
                for (j, p) in row.iter().enumerate() {
                    next[j] += stationary[i] * p;
                }
            }
            stationary = next;
        }
        Markov { vocab, rows, stationary }
    }

    /// The entropy rate `sum_i pi_i H(P_i)` in nats per token: the lowest expected cross-entropy any
    /// next-token predictor can reach on this source.
    pub fn entropy_rate(&self) -> f64 {
        let h = |row: &Vec<f64>| -row.iter().filter(|p| **p > 0.0).map(|p| p * p.ln()).sum::<f64>();
        self.rows.iter().zip(&self.stationary).map(|(row, pi)| pi * h(row)).sum()
    }

    /// The likeliest successor of each token, and the expected accuracy of always guessing it.
    pub fn best_guess(&self) -> (Vec<u32>, f64) {
        let argmax = |row: &Vec<f64>| (0..self.vocab).max_by(|a, b| row[*a].total_cmp(&row[*b])).unwrap_or(0);
        let guesses: Vec<u32> = self.rows.iter().map(|row| argmax(row) as u32).collect();
        let accuracy = self.rows.iter().zip(&self.stationary).map(|(row, pi)| pi * row[argmax(row)]).sum();
        (guesses, accuracy)
    }

    fn sample(dist: &[f64], rng: &mut StdRng) -> usize {
        let u: f64 = rng.random();
        let mut cumulative = dist.iter().scan(0.0, |acc, p| Some(*acc + p).inspect(|c| *acc = *c));
        cumulative.position(|c| c >= u).unwrap_or(dist.len() - 1)
    }

    /// `seqs` sequences of `seq + 1` tokens, each starting from the stationary distribution.
    pub fn sequences(&self, seqs: usize, seq: usize, rng: &mut StdRng) -> Vec<u32> {
        let mut out = Vec::with_capacity(seqs * (seq + 1));
        for _ in 0..seqs {
            let mut token = Self::sample(&self.stationary, rng);
            out.push(token as u32);
            for _ in 0..seq {
                token = Self::sample(&self.rows[token], rng);
                out.push(token as u32);
            }
        }
        out
    }
}

/// Inputs `(seqs, seq)` and next-token targets `(seqs * seq,)`.
pub fn split(
    tokens: Vec<u32>,
    seqs: usize,
    seq: usize,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let all = Tensor::from_vec(tokens, (seqs, seq + 1), device)?;
    Ok((all.narrow(D::Minus1, 0, seq)?, all.narrow(D::Minus1, 1, seq)?.flatten_all()?))
}
