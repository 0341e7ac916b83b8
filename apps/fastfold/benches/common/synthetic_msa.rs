//! A synthetic alignment for the benchmarks that need an MSA of a given depth
//! (`versus_alphafold_multimer.rs`, `predict.rs`): rows drawn from the query by a fixed
//! hash, so that every run aligns the same rows.
use data::a3m::Msa;

/// A fixed hash of (row, column, salt) into [0, 1).
fn draw(row: usize, col: usize, salt: u64) -> f64 {
    let mut x = (row as u64) << 32 ^ (col as u64) ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// `rows` rows aligned to `query` (row 0 the query): each residue changed with probability 0.3,
/// a gap with 0.05.
pub fn synthetic_msa(query: &str, rows: usize, chain: usize) -> Msa {
    let letters = b"ARNDCQEGHILKMFPSTWYV";
    let salt = chain as u64 + 1;
    let sequences: Vec<String> = (0..rows)
        .map(|r| match r {
            0 => query.to_string(),
            _ => query
                .bytes()
                .enumerate()
                .map(|(c, q)| match draw(r, c, salt) {
                    u if u < 0.05 => '-',
                    u if u < 0.35 => letters[(draw(r, c, salt + 100) * 20.0) as usize % 20] as char,
                    _ => q as char,
                })
                .collect(),
        })
        .collect();
    let n = query.len();
    Msa {
        deletion_matrix: vec![vec![0; n]; rows],
        descriptions: (0..rows).map(|r| format!("chain{chain}_row{r}")).collect(),
        sequences,
    }
}
